"""Rotary position embeddings: inverse frequencies of each variant, computed as transformers does, and their rotation.

Variants (model.rope_scaling, of global layers; local layers take plain RoPE at rope_local_theta when set):
none; linear (Gemma 3); llama3 (Llama 3.1); yarn (GPT-OSS; cos and sin times an attention factor); proportional
(Gemma 4's global layers: the first rope_fraction of the frequency pairs rotate, the rest have frequency 0, over the
whole head). Both sides rotate the two halves of a head (rotate_half), so HF weights need no permutation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from configs import ModelConfig

Array = jax.Array


def _plain(theta: float, dim: int, pairs: int | None = None) -> np.ndarray:
    """theta ** (-2i / dim) for the first `pairs` (default dim / 2) pairs, in float32 as transformers computes it."""
    pairs = dim // 2 if pairs is None else pairs
    exponents = np.arange(0, 2 * pairs, 2, dtype=np.float32) / np.float32(dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rope_frequencies(cfg: ModelConfig, local: bool, head_dim: int | None = None) -> np.ndarray:
    """float32 inverse frequencies [head_dim / 2] of a local or global layer's heads (default cfg.head_dim)."""
    dim = head_dim or cfg.head_dim
    if local and cfg.rope_local_theta:
        return _plain(cfg.rope_local_theta, dim)
    scaling, factor = cfg.rope_scaling, np.float32(cfg.rope_factor)
    if scaling == "proportional":
        pairs = int(cfg.rope_fraction * dim // 2)
        inv = np.concatenate([_plain(cfg.rope_theta, dim, pairs), np.zeros(dim // 2 - pairs, np.float32)])
        return (inv / factor).astype(np.float32)
    inv = _plain(cfg.rope_theta, dim)
    if scaling == "linear":
        inv = inv / factor
    elif scaling == "llama3":  # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend between
        old = cfg.rope_original_max_len
        low_wavelen, high_wavelen = old / cfg.rope_low_freq_factor, old / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, blended, scaled)
    elif scaling == "yarn":  # interpolate low frequencies by `factor`, keep high ones, a linear ramp between
        low, high = _yarn_range(cfg, dim)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / ((high - low) or 0.001), 0, 1)
        keep = (1 - ramp).astype(np.float32)
        inv = (inv / factor) * (1 - keep) + inv * keep
    return inv.astype(np.float32)


def _yarn_range(cfg: ModelConfig, dim: int) -> tuple[float, float]:
    """The band of frequency pairs YaRN blends over (transformers' find_correction_range)."""
    def pair(rotations: float) -> float:
        return dim * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = pair(cfg.rope_beta_fast), pair(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def attention_factor(cfg: ModelConfig, local: bool) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor on global layers, else 1."""
    if cfg.rope_scaling != "yarn" or (local and cfg.rope_local_theta):
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0


def rope(x: Array, positions: Array, inv_freq: Array, factor: Array | float = 1.0) -> Array:
    """Rotary embedding on [batch, seq, heads, head_dim], rotating the two halves (HF Llama layout)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, seq, half]
    cos, sin = (jnp.cos(angles) * factor)[:, :, None, :], (jnp.sin(angles) * factor)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
