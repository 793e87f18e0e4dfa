"""A Llama-style decoder in Flax: RMSNorm, RoPE, grouped-query attention, SwiGLU, scanned layers.

Every parameter carries logical axis names (embed, heads, kv, mlp, vocab, layers); `sharding.py`
maps them onto the device mesh. The layer stack is one `nn.scan`, so parameters of the blocks are
stacked along a leading `layers` axis:

    embed/embedding                     [vocab, embed]
    layers/attn_norm/scale              [layers, embed]
    layers/attn/{q,k,v}_proj/kernel     [layers, embed, heads|kv_heads, head_dim]
    layers/attn/o_proj/kernel           [layers, heads, head_dim, embed]
    layers/mlp_norm/scale               [layers, embed]
    layers/mlp/{gate,up}_proj/kernel    [layers, embed, mlp]
    layers/mlp/down_proj/kernel         [layers, mlp, embed]
    final_norm/scale                    [embed]
    lm_head/kernel                      [embed, vocab]   (absent with tie_embeddings)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from configs import ModelConfig

Array = jax.Array

# What the backward pass keeps from the forward pass of each layer (the rest is recomputed):
# none = everything, minimal = the matmul outputs, full = only the layer's input.
REMAT_POLICIES = {
    "none": None,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def _tokens(x: Array) -> Array:
    """[batch, seq, ...] -> [batch * seq, ...]: projections run as 2-D matmuls.

    On CPU, XLA computes a weight gradient that contracts two dims (batch and seq) through a slow
    path: the flat form makes the demo model's step ~1.6x faster. Elsewhere the reshape is free.
    """
    return x.reshape(-1, *x.shape[2:])


def _init(cfg: ModelConfig, axes: tuple[str | None, ...]) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), axes)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as in HF Llama."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (x.shape[-1],), self.param_dtype
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


def rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotary embedding on [batch, seq, heads, head_dim], rotating the two halves (HF Llama layout)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, seq, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_mask(segment_ids: Array | None) -> Array | None:
    """[batch, 1, q, k] mask keeping attention inside a document; None when there are no segments."""
    if segment_ids is None:
        return None
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


class Attention(nn.Module):
    """Grouped-query causal self-attention."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array, mask: Array | None) -> Array:
        cfg = self.cfg
        dtype, pdtype = _dtype(cfg.dtype), _dtype(cfg.param_dtype)

        tokens = _tokens(x)

        def proj(name: str, heads: int, head_axis: str) -> Array:
            return nn.DenseGeneral(
                (heads, cfg.head_dim), use_bias=False, dtype=dtype, param_dtype=pdtype,
                kernel_init=_init(cfg, ("embed", head_axis, "head_dim")), name=name,
            )(tokens).reshape(*x.shape[:2], heads, cfg.head_dim)

        q = rope(proj("q_proj", cfg.num_heads, "heads"), positions, cfg.rope_theta)
        k = rope(proj("k_proj", cfg.num_kv_heads, "kv_heads"), positions, cfg.rope_theta)
        v = proj("v_proj", cfg.num_kv_heads, "kv_heads")
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        # jax.nn.dot_product_attention handles grouped kv heads and picks cuDNN flash attention on GPU.
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
        return nn.DenseGeneral(
            cfg.emb_dim, axis=(-2, -1), use_bias=False, dtype=dtype, param_dtype=pdtype,
            kernel_init=_init(cfg, ("heads", "head_dim", "embed")), name="o_proj",
        )(_tokens(out)).reshape(x.shape)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        dense = lambda feats, axes, name: nn.Dense(  # noqa: E731
            feats, use_bias=False, dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype),
            kernel_init=_init(cfg, axes), name=name,
        )
        tokens = _tokens(x)
        h = nn.silu(dense(cfg.mlp_dim, ("embed", "mlp"), "gate_proj")(tokens)) * dense(cfg.mlp_dim, ("embed", "mlp"), "up_proj")(tokens)
        h = nn.with_logical_constraint(h, ("batch", "mlp"))
        return dense(cfg.emb_dim, ("mlp", "embed"), "down_proj")(h).reshape(x.shape)


class Block(nn.Module):
    """Pre-norm transformer block; shaped for `nn.scan` (returns (carry, None))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array, mask: Array | None) -> tuple[Array, None]:
        cfg = self.cfg
        norm = lambda name: RMSNorm(cfg.norm_eps, _dtype(cfg.dtype), _dtype(cfg.param_dtype), name=name)  # noqa: E731
        x = x + Attention(cfg, name="attn")(norm("attn_norm")(x), positions, mask)
        x = x + MLP(cfg, name="mlp")(norm("mlp_norm")(x))
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class Transformer(nn.Module):
    """Decoder-only LM: tokens [batch, seq] -> float32 logits [batch, seq, vocab]."""

    cfg: ModelConfig
    remat: str = "none"  # a key of REMAT_POLICIES

    @nn.compact
    def __call__(self, tokens: Array, positions: Array | None = None, segment_ids: Array | None = None) -> Array:
        cfg = self.cfg
        dtype, pdtype = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        embed = nn.Embed(
            cfg.vocab_size, cfg.emb_dim, dtype=dtype, param_dtype=pdtype,
            embedding_init=_init(cfg, ("vocab", "embed")), name="embed",
        )
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        block = Block
        if self.remat != "none":
            block = nn.remat(Block, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        layers = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast), length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = layers(cfg, name="layers")(x, positions, attention_mask(segment_ids))
        x = _tokens(RMSNorm(cfg.norm_eps, dtype, pdtype, name="final_norm")(x))
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(
                cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=pdtype,
                kernel_init=_init(cfg, ("embed", "vocab")), name="lm_head",
            )(x)
        logits = logits.reshape(*tokens.shape, cfg.vocab_size)
        return nn.with_logical_constraint(logits.astype(jnp.float32), ("batch", "length", "vocab"))


def param_count(params: dict) -> int:
    """Number of scalars in a parameter tree."""
    return sum(x.size for x in jax.tree_util.tree_leaves(params))
