"""The 2026 families against transformers: GPT-OSS (hub MXFP4 and unquantized) and Gemma 4 (dense and MoE).

Per family a tiny random float32 model with every feature on (tests/trainer/hf_models_2026.py: sinks, biases,
router scales and layer scalars perturbed, windows far shorter than the prompt) is written as the hub has it,
ingested, and compared on a 300-token prompt: logits within 2e-5 x max |HF logit| (as test_families.py: float32
on both sides, different operation orders; a conversion bug is O(1)), equal perplexity, greedy KV-cache decoding
equal to `generate`, and the export loads in transformers with the same weights.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from configs import UserError
from tests.trainer.hf_models_2026 import VOCAB, load_hub_format, save_hub_format, tiny_hf_model
from tests.trainer.test_families import NEW_TOKENS, PROMPT_LEN, _assert_close, _torch_logits
from trainer.eval.decode import generate_batch
from trainer.hf.config import check_hf_config, model_config_from_hf, read_hf_config
from trainer.hf.export import export_hf
from trainer.hf.ingest import ingest
from trainer.model.decoder import Transformer
from trainer.params.reader import abstract_params, load_params
from trainer.train.loss import token_loss

CASES = {  # test id -> (family of the tiny model, hub format options)
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss_mxfp4": ("gpt_oss", {"mxfp4": True}),
    "gemma4": ("gemma4", {}),
    "gemma4_moe": ("gemma4_moe", {"vision": False}),
}


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(1, VOCAB, (1, PROMPT_LEN))


def _text_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The language model's weights by transformers' text-model names (a multimodal wrapper's inner model)."""
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    state = {f"model.{k}": v for k, v in inner.state_dict().items() if not k.endswith("embed_scale")}
    if not model.config.get_text_config().tie_word_embeddings:
        state["lm_head.weight"] = model.lm_head.weight
    return state


@pytest.mark.parametrize("case", list(CASES))
def test_family_round_trip(case, tmp_path, tokens):
    family, options = CASES[case]
    model = tiny_hf_model(family)
    save_hub_format(model, family, tmp_path / "hf", **options)  # (MXFP4 rounds the model's experts in place)
    reference = load_hub_format(tmp_path / "hf")
    hf = read_hf_config(tmp_path / "hf")
    cfg = model_config_from_hf(hf, name=case)
    check_hf_config(hf, cfg)

    # Ingest: logits and perplexity equal transformers' (which dequantizes MXFP4 itself).
    ingest(tmp_path / "hf", tmp_path / "ours", cfg, log=lambda _: None)
    params = load_params(tmp_path / "ours", abstract_params(cfg))
    ref = _torch_logits(reference, tokens)
    ours = np.asarray(jax.jit(Transformer(cfg).apply)({"params": params}, tokens))
    _assert_close(ours, ref)
    with torch.no_grad():
        hf_loss = float(reference(torch.tensor(tokens), labels=torch.tensor(tokens)).loss)
    total, count = token_loss(ours[:, :-1], tokens[:, 1:], np.ones_like(tokens[:, 1:]))
    assert np.exp(float(total / count)) == pytest.approx(np.exp(hf_loss), rel=1e-5)

    # Greedy decoding with our KV cache gives transformers' greedy tokens, for prompts of two lengths.
    prompts = [tokens[0].tolist(), tokens[0, 100:].tolist()]
    for prompt, got in zip(prompts, generate_batch(params, cfg, prompts, NEW_TOKENS)):
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want

    # Export: transformers loads the hub's architecture, with the same weights and logits.
    export_hf(params, cfg, None, tmp_path / "export", log=lambda _: None)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    assert type(back) is type(reference)
    want_state, got_state = _text_state(reference), _text_state(back)
    assert got_state.keys() == want_state.keys()
    for name, tensor in got_state.items():
        assert torch.equal(tensor, want_state[name]), name
    np.testing.assert_allclose(_torch_logits(back, tokens), ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    assert model_config_from_hf(read_hf_config(tmp_path / "export"), case) == cfg
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    assert not any("vision" in name for name in load_file(tmp_path / "export" / "model.safetensors"))


def test_config_fields_of_each_family(tmp_path):
    save_hub_format(tiny_hf_model("gpt_oss"), "gpt_oss", tmp_path / "oss", mxfp4=True)
    oss = model_config_from_hf(read_hf_config(tmp_path / "oss"))
    assert (oss.family, oss.attention_sinks, oss.attention_bias, oss.router_bias, oss.expert_bias) == (
        "gpt_oss", True, True, True, True)
    assert (oss.rope_scaling, oss.rope_truncate, oss.global_every, oss.activation) == ("yarn", False, 2, "silu_clamped")
    save_hub_format(tiny_hf_model("gemma4"), "gemma4", tmp_path / "g4")
    g4 = model_config_from_hf(read_hf_config(tmp_path / "g4"))
    assert (g4.family, g4.global_k_eq_v, g4.v_norm, g4.layer_scalar, g4.rope_scaling) == (
        "gemma4", True, True, True, "proportional")
    assert g4.global_head_dim > g4.head_dim and g4.global_num_kv_heads < g4.num_kv_heads


@pytest.mark.parametrize("change, message", [
    ({"hidden_size_per_layer_input": 256}, "per-layer embeddings"),
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
    ({"use_bidirectional_attention": "all"}, "causal"),
])
def test_gemma4_features_maxpipe_lacks_are_refused_in_one_line(change, message, tmp_path):
    save_hub_format(tiny_hf_model("gemma4"), "gemma4", tmp_path, vision=False)
    hf = read_hf_config(tmp_path)
    hf["text_config"].update(change)
    with pytest.raises(UserError, match=message):
        model_config_from_hf(hf)


def test_unknown_quantization_is_refused(tmp_path):
    save_hub_format(tiny_hf_model("gpt_oss"), "gpt_oss", tmp_path, mxfp4=True)
    hf = read_hf_config(tmp_path)
    with pytest.raises(UserError, match="quantized with 'fp8'"):
        model_config_from_hf(hf | {"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(UserError, match="HF checkpoint is .*model_type 'deepseek_v3'"):
        model_config_from_hf({"model_type": "deepseek_v3"})
