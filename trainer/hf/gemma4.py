"""Gemma 4 (31B dense, 26B-A4B MoE; text) <-> maxpipe: config.json fields and tensor names, both ways.

Against Gemma 3: RMSNorm times w (not 1 + w), q/k norms and a weightless v norm on every layer, attention scale
1, global layers with their own head size and kv heads that reuse the key projection as values (no v_proj) and
proportional RoPE, a learned scalar on each layer's output, a final logit soft-cap. The MoE model runs a dense
MLP and 128 experts side by side in every layer, each post-normed, behind a router with its own scales.
The hub ships the multimodal wrapper: config.json's text_config, tensors under `model.language_model.` beside a
vision tower that ingest skips; ingest also reads transformers' text-only files (`model.`), export writes the hub's
form without a vision tower.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from configs import ModelConfig, UserError
from trainer.hf.common import FEATURES_OFF, hf_base, hf_rope, layer_pattern, rope_fields
from trainer.hf.tensor_spec import TensorSpec, heads_in, heads_out, same, t
from trainer.model.layers import LayerKind, head_geometry, layer_is_global

ARCHITECTURE, MODEL_TYPE = "Gemma4ForConditionalGeneration", "gemma4"
TEXT_TYPE = "gemma4_text"  # the language model's own model_type (Gemma4ForCausalLM)
ARCHITECTURES, MODEL_TYPES = (ARCHITECTURE, "Gemma4ForCausalLM"), (TEXT_TYPE,)
WRAPPER_TYPES = (MODEL_TYPE,)
PREFIX = "model.language_model."  # where the hub's files hold the language model (transformers' text model: model.)
IGNORED = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
QUANTIZATIONS: tuple[str, ...] = ()
FIXED: dict[str, Any] = {k: v for k, v in FEATURES_OFF.items() if not k.startswith("global_")} | dict(
    activation="gelu_tanh", norm_plus_one=False, scale_embeddings=True, qk_norm=True, v_norm=True,
    post_norms=True, layer_scalar=True, query_pre_attn_scalar=1.0, attn_softcap=0.0, router="gemma4",
    router_bias=False, expert_bias=False, moe_dense_mlp=True, router_renormalize=True, moe_every=1,
)


def unwrap(hf: dict) -> dict:
    """The text_config of the hub's multimodal config.json, with the wrapper's architecture."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UserError("HF gemma4 config.json has no text_config: expected the hub's Gemma4ForConditionalGeneration")
    return {**text, "model_type": TEXT_TYPE, "architectures": hf.get("architectures") or [ARCHITECTURE],
            "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))}


def _refuse_unsupported(hf: dict) -> None:
    per_layer_input = hf.get("hidden_size_per_layer_input", 256)  # transformers' default: on (E2B/E4B)
    if per_layer_input:
        raise UserError(f"HF Gemma 4 config has per-layer embeddings (hidden_size_per_layer_input {per_layer_input}, "
                        "the E2B/E4B models); maxpipe supports Gemma 4 31B and 26B-A4B")
    if hf.get("num_kv_shared_layers"):
        raise UserError(f"HF Gemma 4 config shares KV across its last {hf['num_kv_shared_layers']} layers "
                        "(num_kv_shared_layers, E2B/E4B); maxpipe supports Gemma 4 31B and 26B-A4B")
    if hf.get("use_bidirectional_attention") == "all":
        raise UserError("HF config sets use_bidirectional_attention: all; maxpipe's decoder is causal")
    if hf.get("attention_bias"):
        raise UserError("HF Gemma 4 config sets attention_bias: true; maxpipe's Gemma 4 projections have no bias")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UserError(f"HF config uses activation {act!r}; maxpipe's gemma4 MLP is gelu_tanh")


def _global_geometry(hf: dict, types: list[str]) -> tuple[int, int]:
    """(head_dim, kv heads) of global layers: the hub's keys, or transformers 5's per_layer_config."""
    k_eq_v = bool(hf.get("attention_k_eq_v"))
    per_layer = hf.get("per_layer_config") or {}
    full = next((entry for key, entry in per_layer.items() if types[int(key)] == "full_attention"), None)
    if full is not None:
        return full.get("head_dim", hf.get("head_dim", 256)), full.get("num_key_value_heads", 0)
    heads = hf.get("num_global_key_value_heads") if k_eq_v else None
    return hf.get("global_head_dim") or 512, heads or 0


def config_fields(hf: dict) -> dict[str, Any]:
    """Our model fields of a Gemma 4 text config (the hub's or transformers 5's form)."""
    _refuse_unsupported(hf)
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention"
                                      for i in range(n)]
    window, every = layer_pattern(types, n, hf.get("sliding_window", 512) or 0)
    head_dim, kv_heads = _global_geometry(hf, types)
    rope = hf.get("rope_parameters") or {}
    local = rope.get("sliding_attention", {"rope_type": "default", "rope_theta": 10000.0})
    glob = rope.get("full_attention", {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})
    if local.get("rope_type", "default") != "default":
        raise UserError(f"HF config scales local RoPE ({local}); maxpipe supports plain RoPE on local layers")
    fields = dict(
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0), sliding_window=window, global_every=every,
        global_head_dim=head_dim if head_dim != hf.get("head_dim", 256) else 0,
        global_num_kv_heads=kv_heads if kv_heads and kv_heads != hf.get("num_key_value_heads") else 0,
        global_k_eq_v=bool(hf.get("attention_k_eq_v")), rope_local_theta=float(local.get("rope_theta", 10000.0)),
    ) | rope_fields(glob, ("default", "proportional"))
    if not hf.get("enable_moe_block"):
        return fields | dict(num_experts=0, experts_per_token=2, expert_mlp_dim=0, load_balance_weight=0.0,
                             capacity_factor=0.0)
    width = hf.get("moe_intermediate_size") or hf.get("expert_intermediate_size")  # the 31B file's older name
    return fields | dict(num_experts=hf["num_experts"], experts_per_token=hf["top_k_experts"], expert_mlp_dim=width,
                         load_balance_weight=0.0, capacity_factor=0.0)


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """The hub's Gemma4ForConditionalGeneration config.json for `cfg`: the text model, no vision tower."""
    text = hf_base(cfg, "Gemma4ForCausalLM", TEXT_TYPE, bos_id, eos_id)
    head_dim, kv_heads, k_eq_v = head_geometry(cfg, True)
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    text.pop("architectures")
    text.update(
        # The multimodal wrapper maps image placeholders to the pad id, so it needs one: Gemma's is 0.
        pad_token_id=eos_id if eos_id is not None else 0,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=cfg.final_softcap or None,
        sliding_window=cfg.sliding_window or cfg.max_seq_len,
        layer_types=["full_attention" if g else "sliding_attention" for g in layer_is_global(cfg)],
        rope_parameters={"full_attention": hf_rope(cfg), "sliding_attention": local},
        global_head_dim=head_dim, num_global_key_value_heads=kv_heads if k_eq_v else None, attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
        enable_moe_block=cfg.moe, num_experts=cfg.num_experts or None, top_k_experts=cfg.experts_per_token if cfg.moe
        else None, moe_intermediate_size=cfg.expert_width if cfg.moe else None,
    )
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text, "vision_config": None,
            "audio_config": None, "tie_word_embeddings": cfg.tie_embeddings, "dtype": cfg.param_dtype}


def check_exportable(cfg: ModelConfig) -> None:
    if cfg.global_num_kv_heads and not cfg.global_k_eq_v:
        raise UserError("model.family gemma4 gives global layers their own kv heads only with model.global_k_eq_v")
    if not cfg.tie_embeddings:
        raise UserError("model.family gemma4 ties the output head to the embedding: set model.tie_embeddings=true")


def _halves(part: int, f: int) -> tuple:
    """(our [E, D, F] half of the [E, 2F, D] gate_up tensor (gate first), the tensor from both halves)."""
    def join(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([p.transpose(0, 2, 1) for p in parts], axis=1)

    return (lambda w: w[:, part * f:(part + 1) * f].transpose(0, 2, 1)), join


def block_specs(cfg: ModelConfig, kind: LayerKind) -> list[TensorSpec]:
    """One Gemma 4 layer's parameters (stacked under `layers`), of a global or local layer as `kind` says."""
    d, m, h = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads
    hd, kv, k_eq_v = head_geometry(cfg, kind.is_global)
    layer, at = PREFIX + "layers.{i}.", PREFIX + "layers.{i}.self_attn."

    def norm(ours: str, theirs: str, size: int = d) -> TensorSpec:
        return TensorSpec(("layers", ours, "scale"), layer + theirs + ".weight", (size,), same, same)

    specs = [
        norm("attn_norm", "input_layernorm"),
        TensorSpec(("layers", "attn", "q_proj", "kernel"), at + "q_proj.weight", (h * hd, d), *heads_in(d, h, hd)),
        TensorSpec(("layers", "attn", "q_norm", "scale"), at + "q_norm.weight", (hd,), same, same),
        TensorSpec(("layers", "attn", "k_proj", "kernel"), at + "k_proj.weight", (kv * hd, d), *heads_in(d, kv, hd)),
        TensorSpec(("layers", "attn", "k_norm", "scale"), at + "k_norm.weight", (hd,), same, same),
    ]
    if not k_eq_v:
        specs.append(TensorSpec(("layers", "attn", "v_proj", "kernel"), at + "v_proj.weight", (kv * hd, d),
                                *heads_in(d, kv, hd)))
    specs += [
        TensorSpec(("layers", "attn", "o_proj", "kernel"), at + "o_proj.weight", (d, h * hd), *heads_out(d, h, hd)),
        norm("attn_post_norm", "post_attention_layernorm"),
        norm("mlp_norm", "pre_feedforward_layernorm"),
        TensorSpec(("layers", "mlp", "gate_proj", "kernel"), layer + "mlp.gate_proj.weight", (m, d), t, t),
        TensorSpec(("layers", "mlp", "up_proj", "kernel"), layer + "mlp.up_proj.weight", (m, d), t, t),
        TensorSpec(("layers", "mlp", "down_proj", "kernel"), layer + "mlp.down_proj.weight", (d, m), t, t),
        norm("mlp_post_norm", "post_feedforward_layernorm"),
        TensorSpec(("layers", "layer_scalar"), layer + "layer_scalar", (1,), same, same),
    ]
    if not kind.sparse:
        return specs
    e, f = cfg.num_experts, cfg.expert_width
    gate, join = _halves(0, f)
    up, _ = _halves(1, f)
    return specs + [
        norm("dense_post_norm", "post_feedforward_layernorm_1"),
        norm("moe_norm", "pre_feedforward_layernorm_2"),
        norm("moe_post_norm", "post_feedforward_layernorm_2"),
        TensorSpec(("layers", "moe", "router", "kernel"), layer + "router.proj.weight", (e, d), t, t),
        TensorSpec(("layers", "moe", "router_scale"), layer + "router.scale", (d,), same, same),
        TensorSpec(("layers", "moe", "per_expert_scale"), layer + "router.per_expert_scale", (e,), same, same),
        TensorSpec(("layers", "moe", "gate_proj"), layer + "experts.gate_up_proj", (e, 2 * f, d), gate, same,
                   join=join),
        TensorSpec(("layers", "moe", "up_proj"), layer + "experts.gate_up_proj", (e, 2 * f, d), up, same, join=join),
        TensorSpec(("layers", "moe", "down_proj"), layer + "experts.down_proj", (e, d, f),
                   lambda w: w.transpose(0, 2, 1), lambda w: w.transpose(0, 2, 1)),
    ]
