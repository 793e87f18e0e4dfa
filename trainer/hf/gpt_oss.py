"""GPT-OSS (20B, 120B) <-> maxpipe: config.json fields and tensor names, both ways.

Every layer: attention with biases and learned sinks (sliding window of 128 on even layers, full on odd), YaRN
RoPE, and an MoE of clamped-SwiGLU experts with biases behind a router with a bias. On disk the experts of a
layer are one tensor each: `gate_up_proj` [E, embed, 2 * mlp] with gate and up columns interleaved, and
`down_proj` [E, mlp, embed] (x @ W), stored by the hub in MXFP4 (`*_blocks`, `*_scales`; ingest dequantizes
them, mxfp4.py). Export writes them unquantized in the model's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from configs import ModelConfig, UserError
from trainer.hf.common import FEATURES_OFF, hf_base, hf_rope, layer_pattern, rope_fields
from trainer.hf.tensor_spec import TensorSpec, heads_bias, heads_in, heads_out, same, t
from trainer.model.layers import LayerKind, layer_is_global
from trainer.model.mlp import SWIGLU_ALPHA

ARCHITECTURE, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
ARCHITECTURES, MODEL_TYPES = (ARCHITECTURE,), (MODEL_TYPE,)
WRAPPER_TYPES: tuple[str, ...] = ()
PREFIX = "model."
IGNORED: tuple[str, ...] = ()  # tensor name prefixes of the hub's files that are not the language model
QUANTIZATIONS = ("mxfp4",)  # quantization_config.quant_method values ingest reads
FIXED: dict[str, Any] = {k: v for k, v in FEATURES_OFF.items() if k != "activation_limit"} | dict(
    activation="silu_clamped", norm_plus_one=False, scale_embeddings=False, qk_norm=False,
    attention_bias=True, attention_sinks=True, post_norms=False, query_pre_attn_scalar=0.0, attn_softcap=0.0,
    final_softcap=0.0, rope_local_theta=0.0, router="softmax", router_bias=True, expert_bias=True,
    moe_dense_mlp=False, router_renormalize=True, moe_every=1, expert_mlp_dim=0,
)


def unwrap(hf: dict) -> dict:
    return hf


def config_fields(hf: dict) -> dict[str, Any]:
    """Our model fields of a GPT-OSS config.json (the hub's legacy rope_scaling or transformers 5's rope_parameters)."""
    if hf.get("swiglu_alpha", SWIGLU_ALPHA) != SWIGLU_ALPHA:
        raise UserError(f"HF config sets swiglu_alpha {hf['swiglu_alpha']}; maxpipe's clamped SwiGLU uses "
                        f"{SWIGLU_ALPHA}")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    window, every = layer_pattern(types, n, hf.get("sliding_window", 128) or 0)
    rope = {"rope_theta": hf.get("rope_theta", 150000.0), **(hf.get("rope_scaling") or {}),
            **(hf.get("rope_parameters") or {})}
    experts = hf.get("num_local_experts", hf.get("num_experts", 128))
    return dict(
        sliding_window=window, global_every=every, activation_limit=float(hf.get("swiglu_limit", 7.0)),
        num_experts=experts, experts_per_token=hf.get("num_experts_per_tok", 4),
        load_balance_weight=float(hf.get("router_aux_loss_coef", 0.001)), capacity_factor=0.0,
    ) | rope_fields(rope, ("default", "yarn"))


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """GptOssForCausalLM's config.json for `cfg` (unquantized weights)."""
    config = hf_base(cfg, ARCHITECTURE, MODEL_TYPE, bos_id, eos_id)
    config.update(
        layer_types=["full_attention" if g else "sliding_attention" for g in layer_is_global(cfg)],
        sliding_window=cfg.sliding_window or None, rope_parameters=hf_rope(cfg), rope_theta=cfg.rope_theta,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token, swiglu_limit=cfg.activation_limit,
        swiglu_alpha=SWIGLU_ALPHA, router_aux_loss_coef=cfg.load_balance_weight, output_router_logits=False,
    )
    return config


def check_exportable(cfg: ModelConfig) -> None:
    if not cfg.moe:
        raise UserError("model.family gpt_oss is a Mixture of Experts but model.num_experts is 0")


def _columns(part: int) -> tuple:
    """(this part of interleaved [..., 2F] columns, the interleaving of both parts back)."""
    def join(parts: list[np.ndarray]) -> np.ndarray:
        out = np.empty((*parts[0].shape[:-1], 2 * parts[0].shape[-1]), parts[0].dtype)
        out[..., 0::2], out[..., 1::2] = parts
        return out

    return (lambda w: w[..., part::2]), join


def block_specs(cfg: ModelConfig, kind: LayerKind) -> list[TensorSpec]:
    """One GPT-OSS layer's parameters (stacked under `layers`)."""
    d, hd, f, e = cfg.emb_dim, cfg.head_dim, cfg.expert_width, cfg.num_experts
    h, kv = cfg.num_heads, cfg.num_kv_heads
    at, ex = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp.experts."
    specs = [TensorSpec(("layers", "attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", (d,), same, same)]
    for name, heads in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
        specs += [
            TensorSpec(("layers", "attn", name, "kernel"), at + name + ".weight", (heads * hd, d),
                       *heads_in(d, heads, hd)),
            TensorSpec(("layers", "attn", name, "bias"), at + name + ".bias", (heads * hd,), *heads_bias(heads, hd)),
        ]
    specs += [
        TensorSpec(("layers", "attn", "o_proj", "kernel"), at + "o_proj.weight", (d, h * hd), *heads_out(d, h, hd)),
        TensorSpec(("layers", "attn", "o_proj", "bias"), at + "o_proj.bias", (d,), same, same),
        TensorSpec(("layers", "attn", "sinks"), at + "sinks", (h,), same, same),
        TensorSpec(("layers", "mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", (d,), same,
                   same),
        TensorSpec(("layers", "moe", "router", "kernel"), "model.layers.{i}.mlp.router.weight", (e, d), t, t),
        TensorSpec(("layers", "moe", "router", "bias"), "model.layers.{i}.mlp.router.bias", (e,), same, same),
    ]
    for part, name in enumerate(("gate", "up")):
        take, join = _columns(part)
        specs += [
            TensorSpec(("layers", "moe", f"{name}_proj"), ex + "gate_up_proj", (e, d, 2 * f), take, same, join=join),
            TensorSpec(("layers", "moe", f"{name}_bias"), ex + "gate_up_proj_bias", (e, 2 * f), take, same, join=join),
        ]
    return specs + [
        TensorSpec(("layers", "moe", "down_proj"), ex + "down_proj", (e, f, d), same, same),
        TensorSpec(("layers", "moe", "down_bias"), ex + "down_proj_bias", (e, d), same, same),
    ]
