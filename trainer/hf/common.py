"""What the HF adapters share: the features off by default, and RoPE parameters read from and written to config.json."""

from __future__ import annotations

from typing import Any

from configs import ModelConfig, UserError

# The features of the 2025-26 families, off: what every family that lacks them fixes.
FEATURES_OFF: dict[str, Any] = dict(
    v_norm=False, attention_bias=False, attention_sinks=False, global_head_dim=0, global_num_kv_heads=0,
    global_k_eq_v=False, layer_scalar=False, activation_limit=7.0,
)
# A model's MoE options, off (a dense model's, and the plain softmax router's).
ROUTER_PLAIN: dict[str, Any] = dict(router="softmax", router_bias=False, expert_bias=False, moe_dense_mlp=False)
ROPE_DEFAULTS: dict[str, Any] = dict(
    rope_scaling="none", rope_factor=1.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
    rope_original_max_len=8192, rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=True,
    rope_attention_factor=0.0, rope_fraction=1.0,
)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rope_fields(rope: dict, allowed: tuple[str, ...] = ROPE_TYPES) -> dict[str, Any]:
    """Our rope_* fields for one HF RoPE dict (rope_parameters, or rope_theta merged with rope_scaling)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in allowed:
        raise UserError(f"HF config uses RoPE type {rope_type!r} ({rope}); maxpipe supports {', '.join(allowed)} here")
    fields = ROPE_DEFAULTS | {"rope_theta": float(rope.get("rope_theta", 10000.0))}
    rotary = rope.get("partial_rotary_factor", 1.0)
    if rotary != 1.0 and rope_type != "proportional":
        raise UserError(f"HF config sets partial_rotary_factor {rotary} with {rope_type} RoPE; maxpipe rotates the "
                        "whole head (or a proportional share)")
    if rope_type == "default":
        return fields
    fields |= {"rope_scaling": rope_type, "rope_factor": float(rope.get("factor") or 1.0)}
    needed = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}.get(rope_type, ())
    missing = [key for key in needed if rope.get(key) is None]
    if missing:
        raise UserError(f"HF config's {rope_type} RoPE lacks {missing[0]} ({rope})")
    if rope_type == "llama3":
        fields |= {
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_len": int(rope["original_max_position_embeddings"]),
        }
    elif rope_type == "yarn":
        if rope.get("mscale") or rope.get("mscale_all_dim"):
            raise UserError(f"HF config's YaRN sets mscale/mscale_all_dim ({rope}); maxpipe supports YaRN without them")
        fields |= {
            "rope_original_max_len": int(rope["original_max_position_embeddings"]),
            "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
            "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
            "rope_truncate": bool(rope.get("truncate", True)),
            "rope_attention_factor": float(rope.get("attention_factor") or 0.0),
        }
    elif rope_type == "proportional":
        fields["rope_fraction"] = float(rotary)
    return fields


def hf_base(cfg: ModelConfig, arch: str, model_type: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """The config.json keys every family shares, for `cfg` and the tokenizer's BOS and EOS ids."""
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu" if cfg.activation.startswith("silu") else "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        # transformers 5 reads dtype, 4.x reads torch_dtype.
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,
    }


def hf_rope(cfg: ModelConfig) -> dict[str, Any]:
    """The HF RoPE dict (rope_parameters) of cfg's global layers."""
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
                            "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none" and (cfg.rope_scaling != "proportional" or cfg.rope_factor != 1.0):
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_len)
    if cfg.rope_scaling == "yarn":
        rope.update(original_max_position_embeddings=cfg.rope_original_max_len, beta_fast=cfg.rope_beta_fast,
                    beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
        if cfg.rope_attention_factor:
            rope["attention_factor"] = cfg.rope_attention_factor
    if cfg.rope_scaling == "proportional":
        rope["partial_rotary_factor"] = cfg.rope_fraction
    return rope


def layer_pattern(types: list[str] | None, n: int, window: int) -> tuple[int, int]:
    """(sliding_window, global_every) from HF layer_types: every Nth layer full attention, the others sliding."""
    if not window or types is None:
        return (window, 0) if window else (0, 0)
    is_global = [t == "full_attention" for t in types]
    if all(is_global):
        return 0, 0
    every = is_global.index(True) + 1 if any(is_global) else 0
    if len(types) != n or is_global != [bool(every) and (i + 1) % every == 0 for i in range(n)]:
        raise UserError(f"HF config has layer_types {types}; maxpipe supports every Nth layer global, the rest sliding")
    return window, every
