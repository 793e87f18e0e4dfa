"""Every model family against transformers' own implementation: ingest, logits, perplexity, export, greedy decoding.

Per family a tiny random float32 model is saved with save_pretrained, ingested, and compared on a
300-token prompt (long enough that RoPE and sliding-window bugs cannot hide: the window is 48).
Tolerance: max |ours - HF| <= 2e-5 x max |HF logit|. Both sides are float32 with different matmul,
softmax and tanh orders; measured errors are in the module docstring of test_hf.py and below 1e-5
relative here, while a conversion bug (a missing norm offset, a wrong window, RoPE band) is O(1).
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from configs import UserError, load_config
from tests.trainer.hf_models import FAMILIES, VOCAB, tiny_model
from trainer.eval.decode import generate_batch
from trainer.train.loss import token_loss
from trainer.hf.export import export_hf
from trainer.hf.config import (
    check_exportable, check_hf_config, hf_config_from_model, model_config_from_hf, read_hf_config,
)
from trainer.hf.ingest import ingest, load_hf_params
from trainer.model.decoder import Transformer
from trainer.params.reader import abstract_params, load_params

REL_TOL = 2e-5
PROMPT_LEN = 300
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(1, VOCAB, (1, PROMPT_LEN))


def _torch_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= REL_TOL * scale, f"max |ours - HF| = {err:.3g} with logits up to {scale:.3g}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_round_trip(family, tmp_path, tokens):
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "hf")
    hf = read_hf_config(tmp_path / "hf")
    cfg = model_config_from_hf(hf, name=family)
    check_hf_config(hf, cfg)

    # Ingest: logits and perplexity equal transformers'.
    ingest(tmp_path / "hf", tmp_path / "ours", cfg, log=lambda _: None)
    params = load_params(tmp_path / "ours", abstract_params(cfg))
    ref = _torch_logits(model, tokens)
    ours = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, tokens))
    _assert_close(ours, ref)
    with torch.no_grad():
        hf_loss = float(model(torch.tensor(tokens), labels=torch.tensor(tokens)).loss)
    total, count = token_loss(ours[:, :-1], tokens[:, 1:], np.ones_like(tokens[:, 1:]))
    assert float(total / count) == pytest.approx(hf_loss, rel=1e-5)
    assert np.exp(float(total / count)) == pytest.approx(np.exp(hf_loss), rel=1e-5)

    # Greedy decoding with our KV cache gives transformers' greedy tokens (its own cache), for a batch
    # of prompts of different lengths (left padding must not change a row).
    prompts = [tokens[0].tolist(), tokens[0, 100:].tolist()]
    ours_new = generate_batch(params, cfg, prompts, NEW_TOKENS)
    for prompt, got in zip(prompts, ours_new):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want

    # Export: transformers loads it as the same architecture; weights and logits equal the original.
    export_hf(params, cfg, None, tmp_path / "export", log=lambda _: None)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    assert type(back) is type(model)
    original, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() <= original.keys()  # a tied checkpoint may also hold lm_head.weight
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    np.testing.assert_allclose(_torch_logits(back, tokens), ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    assert model_config_from_hf(read_hf_config(tmp_path / "export"), family) == cfg


def test_layer_pattern_and_features_from_config(tmp_path):
    tiny_model("gemma3").save_pretrained(tmp_path)
    cfg = model_config_from_hf(read_hf_config(tmp_path))
    assert (cfg.family, cfg.sliding_window, cfg.global_every) == ("gemma3", 48, 3)
    assert (cfg.qk_norm, cfg.post_norms, cfg.norm_plus_one, cfg.scale_embeddings) == (True, True, True, True)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling, cfg.rope_factor) == (1e6, 1e4, "linear", 8.0)
    hf = read_hf_config(tmp_path)
    with pytest.raises(UserError, match="every Nth layer global"):
        model_config_from_hf(hf | {"layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    with pytest.raises(UserError, match=r"model\.family is 'llama' but the checkpoint's model_type gives 'gemma3'"):
        check_hf_config(hf, cfg.model_copy(update={"family": "llama"}))
    with pytest.raises(UserError, match=r"model\.sliding_window is 64 but the checkpoint's sliding_window gives 48"):
        check_hf_config(hf, cfg.model_copy(update={"sliding_window": 64}))


def test_export_refuses_features_the_family_lacks(tmp_path):
    tiny_model("mistral").save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(read_hf_config(tmp_path / "hf"))
    params = load_hf_params(tmp_path / "hf", cfg)
    llama = cfg.model_copy(update={"family": "llama"})
    with pytest.raises(UserError, match=r"model\.family llama fixes model\.sliding_window to 0"):
        export_hf(params, llama, None, tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["sliding_window"] == 48


def test_ingest_reads_experts_fused_as_transformers_holds_them(tmp_path, monkeypatch):
    """A state_dict() checkpoint (each layer's experts in one tensor, gate and up fused; Mixtral's block_sparse_moe
    named mlp) ingests as save_pretrained's per-expert one, converted layer by layer in blocks of a few rows."""
    monkeypatch.setattr("trainer.hf.ingest._SPLIT_BYTES", 1)
    monkeypatch.setattr("trainer.hf.ingest._BLOCK_BYTES", 3 * 64 * 4)
    for family in ("mixtral", "qwen3_moe"):
        model, out = tiny_model(family), tmp_path / family
        model.save_pretrained(out / "hf")
        state = model.state_dict()
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
        (out / "fused").mkdir()
        save_file({name: t.contiguous() for name, t in state.items()}, out / "fused" / "model.safetensors")
        shutil.copy(out / "hf" / "config.json", out / "fused")
        cfg = model_config_from_hf(read_hf_config(out / "hf"))
        ingest(out / "fused", out / "ours", cfg, log=lambda _: None)
        got, want = load_params(out / "ours", abstract_params(cfg)), load_hf_params(out / "hf", cfg)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), got, want)


@pytest.mark.parametrize("change, message", [
    ({"decoder_sparse_step": 3}, r"model.moe_every \(3\) must divide model.num_layers \(2\)"),
    ({"mlp_only_layers": [0]}, "no others made dense"),
    ({"shared_expert_intermediate_size": 64}, "no shared expert"),
    ({"use_sliding_window": True, "sliding_window": 32}, "full attention only"),
    ({"num_experts": 0}, "expected a Mixture of Experts"),
    ({"num_experts_per_tok": 9}, "experts_per_token .9. exceeds model.num_experts .8."),
])
def test_moe_configs_maxpipe_cannot_run_are_refused(change, message):
    hf = hf_config_from_model(load_config("tiny", ["model.name=tiny_qwen3_moe"]).model, None, None)
    assert model_config_from_hf(hf).num_experts == 8
    with pytest.raises(UserError, match=message):
        model_config_from_hf(hf | change)


def test_moe_settings_are_checked_against_the_family():
    mixtral = load_config("tiny", ["model.name=tiny_mixtral"]).model
    for update, message in [
        ({"family": "mistral"}, r"model\.family mistral fixes model\.num_experts to 0"),
        ({"num_experts": 0}, "is a Mixture of Experts but model.num_experts is 0"),
        ({"router_renormalize": False}, r"model\.family mixtral fixes model\.router_renormalize to True"),
        ({"expert_mlp_dim": 64}, "model.expert_mlp_dim is 64: set it to 0"),
    ]:
        with pytest.raises(UserError, match=message):
            check_exportable(mixtral.model_copy(update=update))
    hf = hf_config_from_model(mixtral, None, None)
    with pytest.raises(UserError, match="model.experts_per_token is 3 but the checkpoint's num_experts_per_tok"):
        check_hf_config(hf, mixtral.model_copy(update={"experts_per_token": 3}))
    check_hf_config(hf, mixtral.model_copy(update={"load_balance_weight": 0.1, "capacity_factor": 1.25}))
    # A dense model's MoE fields do nothing, so a dense checkpoint fits whatever they say.
    dense = load_config("tiny", []).model
    check_hf_config(hf_config_from_model(dense, None, None), dense.model_copy(update={"experts_per_token": 4}))


# Published parameter counts of the real models (their model cards / HF config + safetensors index).
# MoE totals: Mixtral 8x7B's safetensors (46.7B), a Mixtral-8x22B-v0.1 finetune's safetensors metadata (141B),
# Qwen3-30B-A3B's card 30.5B; their active parameters (k experts of each layer, embeddings included) are
# the cards' rounded 12.9B, 39B and 3.3B.
# GPT-OSS: the Hub's safetensors totals (the MXFP4 experts counted unpacked), 116,829,156,672 and 20,914,757,184, the
# gpt-oss model card's 116.83B and 20.91B. The card's active counts (5.13B, 3.61B) leave out the input embedding table
# (a lookup) and count the idle experts' biases as idle; the formula below keeps the embedding and all expert biases,
# so ACTIVE adds the table (201088 x 2880) back to the card's figure.
# Gemma 4: the language model of google/gemma-4-31B-it and -26B-A4B-it summed from their safetensors headers (public
# reports; the checkpoints' totals also hold the vision tower), the card's 30.7B and 25.2B; 26B-A4B active: the card's
# 3.8B (3,822,530,590 by the formula).
# Llama 3 70B: 70,553,706,496, the count public parameter tables give for Meta-Llama-3-70B (the card's 70B). Llama 3.1
# 405B: 405,853,388,800, embeddings + untied head + 126 layers with 8 kv heads by the config.json formula (no public
# safetensors total was found to pin it against; the card's 405B).
PUBLISHED = {
    "llama2_7b": 6_738_415_616, "llama3_8b": 8_030_261_248, "llama3_1_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496, "llama3_1_405b": 405_853_388_800,
    "mistral_7b": 7_241_732_096, "qwen3_0_6b": 596_049_920, "gemma_2b": 2_506_172_416,
    "gemma2_2b": 2_614_341_888, "gemma3_1b": 999_885_952, "mixtral_8x7b": 46_702_792_704,
    "mixtral_8x22b": 140_630_071_296, "qwen3_30b_a3b": 30_532_122_624,
    "gpt_oss_20b": 20_914_757_184, "gpt_oss_120b": 116_829_156_672,
    "gemma4_31b": 30_697_345_340, "gemma4_26b_a4b": 25_233_141_790,
}
ACTIVE = {
    "mixtral_8x7b": 12.9e9, "mixtral_8x22b": 39e9, "qwen3_30b_a3b": 3.3e9,
    "gpt_oss_20b": 3.61e9 + 201088 * 2880, "gpt_oss_120b": 5.13e9 + 201088 * 2880, "gemma4_26b_a4b": 3.8e9,
}


@pytest.mark.parametrize("name", [*PUBLISHED, "tiny_gemma3", "tiny_mistral", "tiny_mixtral", "tiny_qwen3_moe",
                                  "tiny_gpt_oss", "tiny_gemma4", "tiny_gemma4_moe"])
def test_named_configs_build_the_same_model_in_transformers(name, tmp_path):
    from transformers import AutoConfig

    from trainer.model.decoder import param_count

    cfg = load_config("tiny", [f"model.name={name}"]).model
    hf = json.loads(json.dumps(hf_config_from_model(cfg, None, None)))
    check_hf_config(hf, cfg)  # the exported config.json reads back as this model
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    assert type(model).__name__ == hf["architectures"][0]
    ours = param_count(abstract_params(cfg))
    stored = set(model.state_dict())  # + persistent buffers: Gemma 4's layer_scalar is one, stored in its checkpoints
    theirs = sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers() if n in stored)
    assert ours == theirs == PUBLISHED.get(name, ours)
    if name in ACTIVE:
        idle = cfg.num_layers * (cfg.num_experts - cfg.experts_per_token) * 3 * cfg.emb_dim * cfg.expert_width
        assert ours - idle == pytest.approx(ACTIVE[name], rel=0.02)  # Qwen's 3.3B is 3.35B with the embeddings
