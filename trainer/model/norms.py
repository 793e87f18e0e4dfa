"""RMSNorm, computed in float32: times w (Llama, Gemma 4), times (1 + w) (Gemma 1-3), or with no weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from configs import ModelConfig

Array = jax.Array


class RMSNorm(nn.Module):
    """x / rms(x) in float32, times the scale (or 1 + scale when plus_one; no scale unless use_scale)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    plus_one: bool = False
    axis_name: str = "embed"
    use_scale: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if not self.use_scale:
            return y.astype(self.dtype)
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param(
            "scale", nn.with_logical_partitioning(init, (self.axis_name,)), (x.shape[-1],), self.param_dtype
        )
        return (y * (scale.astype(jnp.float32) + (1.0 if self.plus_one else 0.0))).astype(self.dtype)


def norm(cfg: ModelConfig, name: str, axis_name: str = "embed", use_scale: bool = True) -> RMSNorm:
    """The model's RMSNorm (its eps, dtypes and weight convention) as submodule `name`."""
    return RMSNorm(cfg.norm_eps, jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype), cfg.norm_plus_one, axis_name,
                   use_scale, name=name)
