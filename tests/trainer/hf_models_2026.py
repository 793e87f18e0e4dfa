"""Tiny random transformers models of GPT-OSS and Gemma 4 (float32, eager), and hub-format checkpoints of them.

Same idea as `hf_models.py`: every feature of the family is switched on and every parameter that transformers
initialises to 0 or 1 (sinks, biases, router scales, `layer_scalar`) is randomised, so that a converter which drops
or misplaces one of them changes the logits. See docs/hf_gpt_oss_gemma4.md for the forward pass.

* `tiny_hf_model(family, seed)`: "gpt_oss", "gemma4" (dense) or "gemma4_moe".
* `save_hub_format(model, family, out_dir, mxfp4=False, vision=True)`: the directory a user downloading
  openai/gpt-oss-* or google/gemma-4-* has: hub tensor names and the hub's config.json form.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

VOCAB = 512
HIDDEN = 64

# Both families: sequences of ~300 tokens span many windows.
_GPT_OSS_WINDOW = 16
_GEMMA4_WINDOW = 24
_GEMMA4_MOE_WINDOW = 8

_S, _F = "sliding_attention", "full_attention"

# GPT-OSS: hub ordering (sliding on even layers), biases everywhere, sinks, YaRN with truncate False. The YaRN
# context is scaled down (original 64, so max_position_embeddings = 32 * 64 = 2048, which keeps transformers'
# implicit-factor check quiet); with head_dim 16 the ramp covers frequency 1 only, frequency 0 is extrapolated and
# 2..7 interpolated, and truncate=False matters (ramp 0.64 at frequency 1; 0.5 with truncation).
_GPT_OSS = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=64, num_local_experts=8, num_experts_per_tok=4, sliding_window=_GPT_OSS_WINDOW,
    layer_types=[_S, _F], max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    bos_token_id=None, eos_token_id=0, pad_token_id=None,
)

# Gemma 4 text model with every non-E-series feature on. Full layers: head_dim 32 (global_head_dim) with 1 KV head
# (num_global_key_value_heads, which transformers applies only when attention_k_eq_v is True), K=V, proportional
# RoPE on a quarter of the head; sliding layers: head_dim 16, 2 KV heads, default RoPE. PLE and KV sharing off
# (hidden_size_per_layer_input must be 0 explicitly: its default is 256). Token ids are Gemma's (pad 0, eos 1,
# bos 2); the multimodal placeholder ids stay at their defaults, outside this vocabulary, so a random test
# sequence never holds one.
_GEMMA4_COMMON = dict(
    vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=HIDDEN, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    final_logit_softcapping=30.0, hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
    use_bidirectional_attention="vision", tie_word_embeddings=True, max_position_embeddings=4096,
    rope_parameters={
        _S: {"rope_type": "default", "rope_theta": 10000.0},
        _F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)

FAMILIES_2026: dict[str, tuple[str, str, dict]] = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", _GPT_OSS),
    # Gemma 4 31B's 5:1 pattern shortened to 2:1, last layer full (transformers forces that anyway).
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        _GEMMA4_COMMON, num_hidden_layers=6, layer_types=[_S, _S, _F, _S, _S, _F], intermediate_size=128,
        sliding_window=_GEMMA4_WINDOW, enable_moe_block=False,
    )),
    # Gemma 4 26B-A4B: a dense MLP (intermediate_size) in parallel with top-k of num_experts experts in every layer.
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        _GEMMA4_COMMON, num_hidden_layers=4, layer_types=[_S, _F, _S, _F], intermediate_size=96,
        sliding_window=_GEMMA4_MOE_WINDOW, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32,
    )),
}

# The hub ships Gemma 4 as the multimodal wrapper; a tiny vision tower makes the checkpoint also hold
# model.vision_tower.* / model.embed_vision.*, as the real ones do.
_HUB_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    head_dim=16, patch_size=4, position_embedding_size=64, pooling_kernel_size=2,
)
# openai/gpt-oss-20b's config.json: quantization_config exactly as on the hub.
_GPT_OSS_QUANT = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}


def _randomize_gpt_oss(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            p.copy_(1.0 + 0.2 * torch.randn_like(p))  # plain w * x_hat, init 1
        elif leaf == "sinks":
            p.normal_(0, 1.0)
        elif "embed_tokens" in name:
            p.normal_(0, 1.0)
        elif name == "lm_head.weight":
            p.normal_(0, 0.5)  # logits' std ~4
        elif leaf == "gate_up_proj":
            p.normal_(0, 0.5)  # pre-activations' std ~4: a few percent exceed swiglu_limit 7, so the clamps matter
        elif leaf == "gate_up_proj_bias":
            p.normal_(0, 0.5)
        elif leaf == "down_proj":
            p.normal_(0, 0.05)
        elif leaf == "down_proj_bias":
            p.normal_(0, 0.2)
        elif "router" in name:
            p.normal_(0, 0.15 if leaf == "weight" else 0.5)  # logits' std ~1.2 plus a bias that moves the top-k
        elif leaf == "bias":
            p.normal_(0, 0.2)  # q/k/v/o biases
        else:
            p.normal_(0, 0.15)


def _randomize_gemma4(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim == 1 and name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))  # Gemma 4 norms are w * x_hat (init 1), not (1 + w)
        elif "embed_tokens" in name:
            p.normal_(0, 0.4)  # x sqrt(64) on input; tied head: logits std ~3.5, pre-cap max ~15-30 (softcap 30 bends)
        elif name.endswith("router.scale"):
            p.copy_(torch.empty_like(p).uniform_(0.5, 2.0))
        elif name.endswith("router.per_expert_scale"):
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5))
        elif name.endswith("router.proj.weight"):
            p.normal_(0, 2.0)  # the router sees x_hat * scale / sqrt(H): router logits' std ~2, top-k well separated
        elif leaf in ("gate_up_proj", "down_proj"):
            p.normal_(0, 0.15)
        elif p.ndim == 1:
            p.normal_(0, 0.2)  # biases (attention_bias is False here, so none)
        else:
            p.normal_(0, 0.15)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(torch.empty_like(b).uniform_(0.5, 1.5))  # multiplies the whole hidden state after the layer


def tiny_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random float32 eager model of `family` ("gpt_oss", "gemma4", "gemma4_moe") with every feature on."""
    config_cls, model_cls, kwargs = FAMILIES_2026[family]
    config = getattr(transformers, config_cls)(**json.loads(json.dumps(kwargs)))  # deep copy: configs mutate dicts
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        (_randomize_gpt_oss if family == "gpt_oss" else _randomize_gemma4)(model)
    return model.to(torch.float32)


# ---------------------------------------------------------------------------------------------------- MXFP4
# E2M1 magnitudes; code = sign << 3 | index. transformers' table: integrations/mxfp4.py FP4_VALUES.
_FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> blocks uint8 [..., out, in/32, 16] and scales uint8 [..., out, in/32] (hub layout).

    Each run of 32 consecutive `in` values shares the exponent e = ceil(log2(max|v| / 6)) (stored as e + 127), so
    that v / 2**e fits E2M1's [-6, 6]; each value is rounded to the nearest E2M1 number. Byte k of a block holds
    value 2k in its low nibble and value 2k+1 in its high nibble.
    """
    *lead, n_out, n_in = w.shape
    if n_in % 32:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of 32, got {n_in}")
    blocks = w.detach().to(torch.float64).reshape(*lead, n_out, n_in // 32, 32)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, exp)[..., None]
    index = (scaled.abs()[..., None] - _FP4_MAGNITUDES).abs().argmin(-1)
    code = index | (((scaled < 0) & (index > 0)).long() << 3)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.to(torch.uint8), (exp + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `mxfp4_quantize`: [..., out, G, 16] + [..., out, G] -> float32 [..., out, 32 G] (hub layout)."""
    lut = torch.cat([_FP4_MAGNITUDES, -_FP4_MAGNITUDES])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = lut[codes].reshape(*blocks.shape[:-1], 32) * torch.pow(2.0, scales.double() - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1).to(torch.float32)


# ---------------------------------------------------------------------------------------------------- hub format
def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _write(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    for old in out_dir.glob("*.safetensors*"):
        old.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_gpt_oss(model: torch.nn.Module, out_dir: Path, mxfp4: bool) -> None:
    if mxfp4:  # round the experts onto the MXFP4 grid first, so the model and the directory stay equal
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in ("gate_up_proj", "down_proj"):
                    p = getattr(layer.mlp.experts, proj)  # [E, in, out]
                    b, s = mxfp4_quantize(p.transpose(1, 2))
                    p.copy_(mxfp4_dequantize(b, s).transpose(1, 2))
    model.save_pretrained(out_dir)
    tensors = _read_safetensors(out_dir)
    if mxfp4:
        for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = mxfp4_quantize(tensors.pop(name).transpose(1, 2))  # [E, out, in]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    config = json.loads((out_dir / "config.json").read_text())
    # The hub's config.json predates `rope_parameters`: legacy rope_scaling + top-level rope_theta, the original
    # implementation's names experts_per_token / initial_context_length, no swiglu_alpha (1.702 is the default).
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["experts_per_token"] = config["num_experts_per_tok"]
    config["initial_context_length"] = rope["original_max_position_embeddings"]
    config.pop("swiglu_alpha", None)
    if mxfp4:
        config["quantization_config"] = dict(_GPT_OSS_QUANT)
    _write(out_dir, tensors, config)


def _save_gemma4(model: torch.nn.Module, out_dir: Path, vision: bool) -> None:
    text = model.config
    full = text.layer_types.index(_F)
    global_head_dim = text.per_layer_config[full].head_dim
    global_kv_heads = text.per_layer_config[full].num_key_value_heads
    text_dict = text.to_dict()
    for key in ("per_layer_config", "architectures", "dtype", "transformers_version", "_name_or_path"):
        text_dict.pop(key, None)
    mm_config = transformers.Gemma4Config(
        text_config=dict(text_dict, global_head_dim=global_head_dim, num_global_key_value_heads=global_kv_heads),
        vision_config=dict(_HUB_VISION) if vision else None, audio_config=None, tie_word_embeddings=True,
    )
    mm_config._attn_implementation = "eager"
    torch.manual_seed(1234)
    wrapper = transformers.Gemma4ForConditionalGeneration(mm_config).eval()
    with torch.no_grad():
        for name, p in wrapper.named_parameters():
            if "vision" in name:
                p.normal_(0, 0.1)
        missing, unexpected = wrapper.model.language_model.load_state_dict(model.model.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("embed_scale")]:
        raise RuntimeError(f"text weights did not map onto the wrapper: {missing=} {unexpected=}")
    wrapper.save_pretrained(out_dir)
    tensors = _read_safetensors(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    # The hub writes the two global-layer keys, not transformers 5.24's per_layer_config.
    tc = config["text_config"]
    tc.pop("per_layer_config", None)
    tc["global_head_dim"], tc["num_global_key_value_heads"] = global_head_dim, global_kv_heads
    _write(out_dir, tensors, config)


def save_hub_format(model: torch.nn.Module, family: str, out_dir: str | Path, *, mxfp4: bool = False,
                    vision: bool = True) -> Path:
    """Write `model` as the hub has the family, into `out_dir`.

    gpt_oss: `GptOssForCausalLM` names (`model.layers.N...`); with `mxfp4=True` the experts are
    `mlp.experts.{gate_up,down}_proj_{blocks,scales}` uint8 plus the hub's `quantization_config`, and the model's
    expert weights are first rounded in place onto the MXFP4 grid (so `model` and the directory give the same
    logits). The config uses the hub's legacy keys (`rope_scaling`, top-level `rope_theta`).
    gemma4 / gemma4_moe: the multimodal wrapper the hub ships: config.json `model_type "gemma4"`,
    `architectures ["Gemma4ForConditionalGeneration"]`, `text_config {... global_head_dim,
    num_global_key_value_heads ...}`, tensors `model.language_model.*` (lm_head tied, not stored) and, with
    `vision=True`, a tiny random `model.vision_tower.*` / `model.embed_vision.*` that a text ingester must skip.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if family == "gpt_oss":
        _save_gpt_oss(model, out_dir, mxfp4)
    elif family in ("gemma4", "gemma4_moe"):
        if mxfp4:
            raise ValueError("MXFP4 is GPT-OSS only")
        _save_gemma4(model, out_dir, vision)
    else:
        raise ValueError(f"unknown family {family!r}")
    return out_dir


def load_hub_format(path: str | Path, *, dequantize: bool = True) -> torch.nn.Module:
    """transformers' own view of a `save_hub_format` directory (float32, eager), for parity tests.

    MXFP4 needs `Mxfp4Config(dequantize=True)` in this venv: without `accelerate` the quantizer refuses to load at
    all, and without `kernels`/`triton` it would dequantize anyway.
    """
    kwargs = {}
    config = json.loads((Path(path) / "config.json").read_text())
    if dequantize and config.get("quantization_config", {}).get("quant_method") == "mxfp4":
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()


def _self_check(prompt_len: int = 300) -> None:
    """python -m tests.trainer.hf_models_2026: every builder saves, reloads and matches itself."""
    tokens = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    cases = [("gpt_oss", False), ("gpt_oss", True), ("gemma4", False), ("gemma4_moe", False)]
    for family, mxfp4 in cases:
        model = tiny_hf_model(family)
        with tempfile.TemporaryDirectory() as tmp:
            save_hub_format(model, family, tmp, mxfp4=mxfp4)
            with torch.no_grad():
                ref = model(tokens).logits
                got = load_hub_format(tmp)(tokens).logits
        assert torch.isfinite(ref).all()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        print(f"{family:11s} mxfp4={mxfp4!s:5s} max|logit|={ref.abs().max().item():6.2f} "
              f"std={ref.std().item():5.2f} rel diff={rel:.1e}")
        assert rel < 2e-5, rel


if __name__ == "__main__":
    _self_check()
