"""Gated feed-forward: SwiGLU (silu), GeGLU (gelu_tanh), or GPT-OSS's clamped SwiGLU (silu_clamped)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from configs import ModelConfig
from trainer.model.linears import Linear

Array = jax.Array
SWIGLU_ALPHA = 1.702  # GPT-OSS's sigmoid sharpness (transformers' swiglu_alpha; MaxText hard-codes it too)


def gated(cfg: ModelConfig) -> Callable[[Array, Array], Array]:
    """The activation combining gate and up projections: act(gate) * up, or GPT-OSS's clamped form."""
    if cfg.activation == "silu":
        return lambda gate, up: nn.silu(gate) * up
    if cfg.activation == "gelu_tanh":
        return lambda gate, up: nn.gelu(gate, approximate=True) * up
    limit = cfg.activation_limit

    def clamped(gate: Array, up: Array) -> Array:  # (clip(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * SWIGLU_ALPHA)

    return clamped


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), each projection [embed, mlp] or [mlp, embed]."""

    cfg: ModelConfig
    width: int = 0  # 0: cfg.mlp_dim

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        width = self.width or cfg.mlp_dim
        dtypes = dict(init_std=cfg.init_std, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))
        gate = checkpoint_name(Linear((width,), ("embed", "mlp"), name="gate_proj", **dtypes)(x), "mlp_gate")
        up = checkpoint_name(Linear((width,), ("embed", "mlp"), name="up_proj", **dtypes)(x), "mlp_up")
        h = nn.with_logical_constraint(gated(cfg)(gate, up), ("batch", "length", "mlp"))
        return checkpoint_name(Linear((cfg.emb_dim,), ("mlp", "embed"), name="down_proj", **dtypes)(h), "mlp_out")
