"""HF <-> maxpipe conversion, checked against transformers' own LlamaForCausalLM (torch, CPU, float32)."""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from configs import UserError
from trainer.hf.export import export_hf
from trainer.hf.config import check_hf_config, model_config_from_hf, read_hf_config
from trainer.hf.ingest import ingest, load_hf_params
from trainer.model.decoder import Transformer
from trainer.params.reader import abstract_params, check_shapes, load_params
from trainer.hf.tokenizer import load_tokenizer

# Max |ours - HF| relative to max |HF logit|, measured on 300-token prompts: 1.0e-6 (ingest, logits
# up to 5.3, diff 5.1e-6), 7.4e-7 (tied, logits up to 45, diff 3.3e-5), 2.9e-7 (export of a random
# init). Both sides are float32 with different matmul and softmax orders, so rounding grows with the
# logits' size; a conversion bug (RoPE pairing, a norm not copied, a transposed kernel) is O(1) relative.
REL_TOL = 2e-5
PROMPT_LEN = 300  # long enough that a RoPE pairing bug cannot hide


def _hf_model(tie: bool = False, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A tiny GQA Llama with weights large enough for non-uniform attention and norms away from 1."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 1.0 if "embed" in name else 0.15)
    return model.to(dtype)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    _hf_model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 512, (1, PROMPT_LEN))


def _torch_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _our_logits(params, cfg, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(Transformer(cfg).apply({"params": params}, tokens))


def _assert_logits_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= REL_TOL * scale, f"max |ours - HF| = {err:.3g} with logits up to {scale:.3g}"


def _tokenizer_dir(path: Path, bos: str | None = None) -> Path:
    """What prep writes: tokenizer/tokenizer.json (a small byte-level BPE) and special_tokens.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", *([bos] if bos else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"] * 50, trainer)
    out = path / "tokenizer"
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "special_tokens.json").write_text(json.dumps({
        "kind": "hf", "vocab_size": tok.get_vocab_size(), "eos_id": tok.token_to_id("<|endoftext|>"),
        "eos_token": "<|endoftext|>", "bos_id": tok.token_to_id(bos) if bos else None, "bos_token": bos,
        "prepend_bos": bos is not None, "append_eos": True,
    }))
    return path


def test_model_config_from_hf_reads_both_rope_spellings(hf_dir):
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf, name="tiny-hf")
    sizes = (cfg.vocab_size, cfg.emb_dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim)
    assert sizes == (512, 64, 2, 4, 2, 16, 128)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings, cfg.max_seq_len) == (10000.0, 1e-5, False, 1024)
    assert "rope_parameters" in hf  # transformers 5 spelling
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"} | {"rope_theta": 500000.0, "rope_scaling": None}
    assert model_config_from_hf(legacy).rope_theta == 500000.0


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 8.0}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
    ({"architectures": ["PhiForCausalLM"], "model_type": "phi"}, "PhiForCausalLM"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "llama"}, "MistralForCausalLM"),
    ({"attention_bias": True}, "attention_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
])
def test_unsupported_hf_configs_are_refused(hf_dir, change, message):
    with pytest.raises(UserError, match=message):
        model_config_from_hf(read_hf_config(hf_dir) | change)


def test_ingest_matches_hf_logits(hf_dir, tmp_path, tokens):
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    stats = ingest(hf_dir, tmp_path / "ours", cfg, log=lambda _: None)
    assert stats["parameters"] == 139_584 and stats["dtype"] == "float32"
    assert stats["hf_config"]["architectures"] == ["LlamaForCausalLM"]
    assert [p.name for p in (tmp_path / "ours").iterdir()] == ["params"]  # nothing else left behind

    params = load_params(tmp_path / "ours", abstract_params(cfg))
    ref = _torch_logits(LlamaForCausalLM.from_pretrained(hf_dir).eval(), tokens)
    _assert_logits_close(_our_logits(params, cfg, tokens), ref)


def test_sharded_checkpoint_ingests_identically(hf_dir, tmp_path):
    _hf_model().save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    single, sharded = load_hf_params(hf_dir, cfg), load_hf_params(tmp_path, cfg)
    check_shapes(single, abstract_params(cfg))
    jax.tree.map(np.testing.assert_array_equal, single, sharded)


def test_tied_embeddings(tmp_path, tokens):
    model = _hf_model(tie=True)
    model.save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(read_hf_config(tmp_path / "hf"))
    assert cfg.tie_embeddings
    params = load_hf_params(tmp_path / "hf", cfg)
    assert "lm_head" not in params
    _assert_logits_close(_our_logits(params, cfg, tokens), _torch_logits(model, tokens))


def test_export_loads_in_transformers(hf_dir, tmp_path, tokens):
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    params = nn.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(1), tokens[:, :8])["params"])
    tok_dir = _tokenizer_dir(tmp_path / "prep")
    out = tmp_path / "export"
    stats = export_hf(params, cfg, tok_dir, out, log=lambda _: None)
    assert stats["tokenizer"] == "hf" and "model.safetensors" in stats["files"]

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    _assert_logits_close(_our_logits(params, cfg, tokens), _torch_logits(model, tokens))

    from tokenizers import Tokenizer

    special = json.loads((tok_dir / "tokenizer" / "special_tokens.json").read_text())
    hf_tok = AutoTokenizer.from_pretrained(out)
    text = "def g(y):\n    return os.getcwd() + y\n"
    ids = Tokenizer.from_file(str(tok_dir / "tokenizer" / "tokenizer.json")).encode(text).ids
    assert hf_tok(text)["input_ids"] == ids and hf_tok.decode(ids) == text
    assert hf_tok.eos_token_id == special["eos_id"] == model.config.eos_token_id == model.generation_config.eos_token_id
    assert not list(tmp_path.glob(".export*"))  # no temp or old directories left behind


def test_export_tokenizer_adds_bos_as_prep_did(hf_dir, tmp_path):
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    tok_dir = _tokenizer_dir(tmp_path / "prep", bos="<s>")
    export_hf(load_hf_params(hf_dir, cfg), cfg, tok_dir / "tokenizer", tmp_path / "export", log=lambda _: None)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = load_tokenizer(tok_dir / "tokenizer")
    assert hf_tok("import os")["input_ids"] == [ours.bos_id, *ours.encode("import os")]
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)


def test_round_trip_hf_ours_hf_is_exact(hf_dir, tmp_path):
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    export_hf(load_hf_params(hf_dir, cfg), cfg, None, tmp_path / "back", log=lambda _: None)
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, back[name]), name
    assert model_config_from_hf(read_hf_config(tmp_path / "back"), cfg.name) == cfg


def test_bfloat16_checkpoint_round_trip(tmp_path):
    _hf_model(dtype=torch.bfloat16).save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(read_hf_config(tmp_path / "hf")).model_copy(update={"param_dtype": "bfloat16"})
    params = load_hf_params(tmp_path / "hf", cfg)
    assert params["embed"]["embedding"].dtype == jax.numpy.bfloat16
    export_hf(params, cfg, None, tmp_path / "back", log=lambda _: None)
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    for name, tensor in original.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(tensor, back[name]), name
    widened = load_hf_params(tmp_path / "hf", cfg.model_copy(update={"param_dtype": "float32"}))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b, np.float32)), widened, params)
    assert widened["embed"]["embedding"].dtype == np.float32


def test_config_mismatch_names_parameter_and_both_shapes(hf_dir):
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf).model_copy(update={"mlp_dim": 96})
    with pytest.raises(UserError, match=r"model\.mlp_dim is 96 but the checkpoint's intermediate_size gives 128"):
        check_hf_config(hf, cfg)
    shapes = r"model\.layers\.0\.mlp\.gate_proj\.weight is \(128, 64\) in the checkpoint but \(96, 64\) in the model"
    with pytest.raises(UserError, match=shapes):
        load_hf_params(hf_dir, cfg)
    with pytest.raises(UserError, match="model.num_layers"):
        ingest(hf_dir, "/nonexistent", model_config_from_hf(hf).model_copy(update={"num_layers": 1}))


def test_export_refuses_params_of_another_shape(hf_dir, tmp_path):
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    params = load_hf_params(hf_dir, cfg)
    with pytest.raises(UserError, match="mlp"):
        export_hf(params, cfg.model_copy(update={"mlp_dim": 96}), None, tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_failed_export_leaves_previous_export_intact(hf_dir, tmp_path):
    cfg = model_config_from_hf(read_hf_config(hf_dir))
    params = load_hf_params(hf_dir, cfg)
    out = tmp_path / "out"
    export_hf(params, cfg, None, out, log=lambda _: None)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UserError, match="special_tokens.json"):
        export_hf(params, cfg, tmp_path / "no-tokenizer", out, log=lambda _: None)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_pickle_only_checkpoint_is_refused(hf_dir, tmp_path):
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    torch.save({"model.norm.weight": torch.ones(64)}, tmp_path / "pytorch_model.bin")
    cfg = model_config_from_hf(read_hf_config(tmp_path))
    with pytest.raises(UserError, match=r"pickle weights \(pytorch_model\.bin\).*safetensors only"):
        load_hf_params(tmp_path, cfg)


def test_pickle_checkpoint_reads_only_when_allowed(hf_dir, tmp_path):
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    model = _hf_model(dtype=torch.bfloat16)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    cfg = model_config_from_hf(read_hf_config(tmp_path)).model_copy(update={"param_dtype": "bfloat16"})
    with pytest.raises(UserError, match="hf_allow_pickle=true"):
        ingest(tmp_path, tmp_path / "out", cfg, log=lambda _: None)
    model.save_pretrained(tmp_path / "st")
    from_pickle = load_hf_params(tmp_path, cfg, allow_pickle=True)
    jax.tree.map(np.testing.assert_array_equal, from_pickle, load_hf_params(tmp_path / "st", cfg))


def test_truncated_safetensors_is_refused(hf_dir, tmp_path):
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    data = (hf_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(UserError, match="truncated"):
        load_hf_params(tmp_path, model_config_from_hf(read_hf_config(tmp_path)))
