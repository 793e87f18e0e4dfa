"""Causal self-attention: grouped-query heads with the options of each family, its masks and its KV cache.

Options (model config): biases on the projections (GPT-OSS), QK-norm before RoPE (Qwen3, Gemma 3/4), a
scale-free norm on values (Gemma 4), keys reused as values on global layers (Gemma 4), learned sinks that add a
logit per head to every softmax row (GPT-OSS), soft-capped scores (Gemma 2), a sliding window on local layers,
and global layers with their own head size and kv heads (Gemma 4). The scores run through the kernel chosen for
the devices (kernels.py: XLA, cuDNN flash attention or splash).

Causality is by position (a query sees the keys at or before its position), so it holds for a sequence reordered for
context parallelism (context.py) too; the keys and values are laid out whole on every context shard, the queries
split. Activations carry names for rematerialisation policies (jax.ad_checkpoint.checkpoint_name): query_proj,
key_proj, value_proj (the projections), attention_out (the heads' output before o_proj) and out_proj (o_proj's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from configs import ModelConfig
from trainer.model.kernels import flash_attention, xla_attention
from trainer.model.layers import head_geometry, layer_is_global
from trainer.model.linears import Linear
from trainer.model.norms import norm
from trainer.model.rope import attention_factor, rope, rope_frequencies

Array = jax.Array


def attention_mask(segment_ids: Array | None) -> Array | None:
    """[batch, 1, q, k] mask keeping attention inside a document; None when there are no segments."""
    if segment_ids is None:
        return None
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def causal_mask(positions: Array) -> Array:
    """[batch, 1, q, k] mask of the keys at or before each query's position, whatever order the tokens are in."""
    return (positions[:, :, None] >= positions[:, None, :])[:, None]


def masks(
    cfg: ModelConfig, positions: Array, segment_ids: Array | None, cache: dict | None
) -> tuple[dict, Array | None]:
    """Attention masks [batch, 1, q, k] for global and/or local layers, and the cache's slot positions.

    Without a cache or a window, only documents: the kernel adds causality (see Attention).
    """
    kinds = set(layer_is_global(cfg).tolist())
    if cache is None and not cfg.sliding_window:
        return {"global": attention_mask(segment_ids)}, None
    q_pos = positions
    if cache is None:
        k_pos = positions
        mask = q_pos[:, :, None] >= k_pos[:, None, :]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    else:  # slots up to the last new token that hold a position (left padding has none)
        k_pos = jax.lax.dynamic_update_slice(cache["pos"], positions.astype(jnp.int32), (0, cache["index"]))
        q_slot = cache["index"] + jnp.arange(positions.shape[1])
        mask = (jnp.arange(k_pos.shape[1])[None, :] <= q_slot[:, None])[None] & (k_pos >= 0)[:, None, :]
    out = {}
    if True in kinds:
        out["global"] = mask[:, None]
    if False in kinds:
        out["local"] = (mask & (q_pos[:, :, None] - k_pos[:, None, :] < cfg.sliding_window))[:, None]
    return out, (k_pos if cache is not None else None)


class Attention(nn.Module):
    """Grouped-query causal self-attention, optionally reading and extending a KV cache.

    `is_global` is the layer's kind: static when `kind` is set (layers.LayerKind), else a scanned boolean.
    `layer_masks` holds what the kernel masks with: dense masks for XLA (see `masks`), segment ids (if any) for a
    flash kernel. Decoding with a cache always runs XLA's attention.
    """

    cfg: ModelConfig
    kernel: str = "xla"
    mesh: jax.sharding.Mesh | None = None
    kind: bool | None = None

    @nn.compact
    def __call__(
        self, x: Array, positions: Array, layer_masks: dict, is_global: Array, kv: dict | None, index: Array | None
    ) -> tuple[Array, dict | None]:
        cfg = self.cfg
        head_dim, kv_heads, k_eq_v = head_geometry(cfg, self.kind)
        dtypes = dict(init_std=cfg.init_std, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                      use_bias=cfg.attention_bias)

        def proj(name: str, heads: int, head_axis: str, remat_name: str) -> Array:
            out = Linear((heads, head_dim), ("embed", head_axis, "head_dim"), name=name, **dtypes)(x)
            out = nn.with_logical_constraint(out, ("batch", "length", head_axis, "head_dim"))
            return checkpoint_name(out, remat_name)

        q = proj("q_proj", cfg.num_heads, "heads", "query_proj")
        k = proj("k_proj", kv_heads, "kv_heads", "key_proj")
        v = k if k_eq_v else proj("v_proj", kv_heads, "kv_heads", "value_proj")
        if cfg.qk_norm:
            q, k = norm(cfg, "q_norm", "head_dim")(q), norm(cfg, "k_norm", "head_dim")(k)
        if cfg.v_norm:
            v = norm(cfg, "v_norm", "head_dim", use_scale=False)(v)
        if self.kind is None:
            glob, local = rope_frequencies(cfg, False, head_dim), rope_frequencies(cfg, True, head_dim)
            inv_freq = jnp.where(is_global, glob, local)
            factor = jnp.where(is_global, attention_factor(cfg, False), attention_factor(cfg, True))
        else:
            inv_freq, factor = rope_frequencies(cfg, not self.kind, head_dim), attention_factor(cfg, not self.kind)
        q, k = rope(q, positions, inv_freq, factor), rope(k, positions, inv_freq, factor)
        # Queries keep their context shard of the sequence; keys and values, projected on it, are then gathered whole.
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        k = nn.with_logical_constraint(k, ("batch", None, "kv_heads", "head_dim"))
        v = nn.with_logical_constraint(v, ("batch", None, "kv_heads", "head_dim"))
        sinks = None
        if cfg.attention_sinks:
            init = nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ("heads",))
            sinks = self.param("sinks", init, (cfg.num_heads,), jnp.dtype(cfg.param_dtype))
        if kv is not None:  # write this step's keys/values at slot `index`, attend over the whole cache
            k = jax.lax.dynamic_update_slice(kv["k"], k.astype(kv["k"].dtype), (0, index, 0, 0))
            v = jax.lax.dynamic_update_slice(kv["v"], v.astype(kv["v"].dtype), (0, index, 0, 0))
            kv = {"k": k, "v": v}
        scale = (cfg.query_pre_attn_scalar or head_dim) ** -0.5
        if self.kernel != "xla" and kv is None:
            def run(window: int) -> Array:
                return flash_attention(self.kernel, q, k, v, layer_masks.get("segment_ids"), scale=scale,
                                       softcap=cfg.attn_softcap, window=window, sinks=sinks, mesh=self.mesh)

            kinds = set(layer_is_global(cfg).tolist()) if self.kind is None else {self.kind}
            if len(kinds) == 2:  # the window is static to a kernel: one for each kind of layer, chosen per layer
                out = jax.lax.cond(is_global, lambda: run(0), lambda: run(cfg.sliding_window))
            else:
                out = run(0 if True in kinds else cfg.sliding_window)
        else:
            if self.kind is not None:
                mask = layer_masks["global" if self.kind else "local"]
            elif len(layer_masks) == 2:  # local and global layers: this layer's kind is a scanned input
                mask = jnp.where(is_global, layer_masks["global"], layer_masks["local"])
            else:
                (mask,) = layer_masks.values()
            # Without a cache or a window, causality is the plain lower triangle (no dense mask to build) unless
            # the sequence is reordered over context shards.
            causal = kv is None and not cfg.sliding_window
            if causal and self.mesh is not None and self.mesh.shape.get("context", 1) > 1:
                mask, causal = causal_mask(positions) & (True if mask is None else mask), False
            out = xla_attention(q, k, v, mask, causal, scale, cfg.attn_softcap, sinks)
        out = checkpoint_name(out, "attention_out")
        out = Linear((cfg.emb_dim,), ("heads", "head_dim", "embed"), name="o_proj", **dtypes)(out)
        return checkpoint_name(out, "out_proj"), kv
