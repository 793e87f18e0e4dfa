"""A decoder-only transformer in Flax covering the Llama, Mistral, Qwen3, Gemma 1/2/3, Mixtral and Qwen3-MoE families.

One module, switched by config features (see the `model:` section of configs/base.yml): RMSNorm
(optionally (1 + w), Gemma), RoPE (plain, linear or Llama 3.1 scaled; its own base on local layers),
grouped-query attention (optional QK-norm, query pre-attention scalar, logit soft-capping, sliding
window on local layers), gated MLP (SwiGLU or GeGLU), optional post-attention/post-MLP norms,
embedding scaling and final logit soft-capping, Mixture-of-Experts MLPs (trainer/model/routing.py), and an optional
KV cache for decoding. Attention runs through the kernel chosen for the devices (trainer/model/kernels.py: XLA,
cuDNN flash attention or splash).

Every parameter carries logical axis names (embed, heads, kv, mlp, vocab, experts, layers); `sharding.py`
maps them onto the device mesh. The layer stack is one `nn.scan`, so parameters of the blocks are
stacked along a leading `layers` axis; whether a layer is local or global is a scanned input. When dense
and MoE layers interleave (moe_every > 1), the scanned unit is a group of moe_every blocks whose last is
MoE (`Blocks`), and each block's parameters sit under layers/block_{j}/ stacked over the groups:

    embed/embedding                     [vocab, embed]
    layers/attn_norm/scale              [layers, embed]
    layers/attn/{q,k,v}_proj/kernel     [layers, embed, heads|kv_heads, head_dim]
    layers/attn/{q,k}_norm/scale        [layers, head_dim]     (qk_norm)
    layers/attn/o_proj/kernel           [layers, heads, head_dim, embed]
    layers/attn_post_norm/scale         [layers, embed]        (post_norms)
    layers/mlp_norm/scale               [layers, embed]
    layers/mlp/{gate,up}_proj/kernel    [layers, embed, mlp]
    layers/mlp/down_proj/kernel         [layers, mlp, embed]
    layers/moe/router/kernel            [layers, embed, experts]          (num_experts > 0, instead of mlp)
    layers/moe/{gate,up}_proj           [layers, experts, embed, mlp]
    layers/moe/down_proj                [layers, experts, mlp, embed]
    layers/mlp_post_norm/scale          [layers, embed]        (post_norms)
    final_norm/scale                    [embed]
    lm_head/kernel                      [embed, vocab]   (absent with tie_embeddings)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

from configs import ModelConfig
from trainer.model import routing as moe
from trainer.model.kernels import flash_attention, xla_attention

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


def _softcap(x: Array, cap: float) -> Array:
    return cap * jnp.tanh(x / cap) if cap else x


def layer_is_global(cfg: ModelConfig) -> np.ndarray:
    """Per layer: True where it attends to the whole context, False where it uses the sliding window."""
    i = np.arange(cfg.num_layers)
    if not cfg.sliding_window:
        return np.ones(cfg.num_layers, bool)
    return (i + 1) % cfg.global_every == 0 if cfg.global_every else np.zeros(cfg.num_layers, bool)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as in HF Llama; times (1 + scale) when plus_one (Gemma)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    plus_one: bool = False
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param(
            "scale", nn.with_logical_partitioning(init, (self.axis_name,)), (x.shape[-1],), self.param_dtype
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (scale.astype(jnp.float32) + (1.0 if self.plus_one else 0.0))).astype(self.dtype)


def _norm(cfg: ModelConfig, name: str, axis_name: str = "embed") -> RMSNorm:
    return RMSNorm(cfg.norm_eps, _dtype(cfg.dtype), _dtype(cfg.param_dtype), cfg.norm_plus_one, axis_name, name=name)


def rope_frequencies(cfg: ModelConfig, local: bool) -> np.ndarray:
    """float32 inverse frequencies [head_dim / 2] of a local or global layer, computed as HF does."""
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    scaling = "none" if local and cfg.rope_local_theta else cfg.rope_scaling
    if scaling == "linear":
        inv = inv / np.float32(cfg.rope_factor)
    elif scaling == "llama3":  # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend between
        factor, old = cfg.rope_factor, cfg.rope_original_max_len
        low_wavelen, high_wavelen = old / cfg.rope_low_freq_factor, old / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, blended, scaled)
    return inv.astype(np.float32)


def rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotary embedding on [batch, seq, heads, head_dim], rotating the two halves (HF Llama layout)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, seq, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_mask(segment_ids: Array | None) -> Array | None:
    """[batch, 1, q, k] mask keeping attention inside a document; None when there are no segments."""
    if segment_ids is None:
        return None
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def init_cache(cfg: ModelConfig, batch: int, length: int) -> dict[str, Array]:
    """An empty KV cache of `length` slots: per-layer keys/values, each slot's position (-1 = empty), next slot."""
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return {
        "k": jnp.zeros(shape, _dtype(cfg.dtype)),
        "v": jnp.zeros(shape, _dtype(cfg.dtype)),
        "pos": jnp.full((batch, length), -1, jnp.int32),
        "index": jnp.int32(0),
    }


class Attention(nn.Module):
    """Grouped-query causal self-attention, optionally reading and extending a KV cache.

    `masks` holds what the kernel masks with: dense masks for XLA (see `_masks`), segment ids (if any) for a
    flash kernel. Decoding with a cache always runs XLA's attention.
    """

    cfg: ModelConfig
    kernel: str = "xla"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(
        self, x: Array, positions: Array, masks: dict, is_global: Array, kv: dict | None, index: Array | None
    ) -> tuple[Array, dict | None]:
        cfg = self.cfg
        dtype, pdtype = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
        tokens = _tokens(x)

        def proj(name: str, heads: int, head_axis: str) -> Array:
            return nn.DenseGeneral(
                (heads, cfg.head_dim), use_bias=False, dtype=dtype, param_dtype=pdtype,
                kernel_init=_init(cfg, ("embed", head_axis, "head_dim")), name=name,
            )(tokens).reshape(*x.shape[:2], heads, cfg.head_dim)

        q, k = proj("q_proj", cfg.num_heads, "heads"), proj("k_proj", cfg.num_kv_heads, "kv_heads")
        v = proj("v_proj", cfg.num_kv_heads, "kv_heads")
        if cfg.qk_norm:
            q, k = _norm(cfg, "q_norm", "head_dim")(q), _norm(cfg, "k_norm", "head_dim")(k)
        inv_freq = jnp.where(is_global, rope_frequencies(cfg, local=False), rope_frequencies(cfg, local=True))
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        if kv is not None:  # write this step's keys/values at slot `index`, attend over the whole cache
            k = jax.lax.dynamic_update_slice(kv["k"], k.astype(kv["k"].dtype), (0, index, 0, 0))
            v = jax.lax.dynamic_update_slice(kv["v"], v.astype(kv["v"].dtype), (0, index, 0, 0))
            kv = {"k": k, "v": v}
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        if self.kernel != "xla" and kv is None:
            def run(window: int) -> Array:
                return flash_attention(self.kernel, q, k, v, masks.get("segment_ids"), scale=scale,
                                       softcap=cfg.attn_softcap, window=window, mesh=self.mesh)

            kinds = set(layer_is_global(cfg).tolist())
            if len(kinds) == 2:  # the window is static to a kernel: one for each kind of layer, chosen per layer
                out = jax.lax.cond(is_global, lambda: run(0), lambda: run(cfg.sliding_window))
            else:
                out = run(0 if True in kinds else cfg.sliding_window)
        else:
            if len(masks) == 2:  # local and global layers: this layer's kind is a scanned input
                mask = jnp.where(is_global, masks["global"], masks["local"])
            else:
                (mask,) = masks.values()
            # Without a cache or a window, causality is the plain lower triangle: no dense mask to build.
            causal = kv is None and not cfg.sliding_window
            out = xla_attention(q, k, v, mask, causal, scale, cfg.attn_softcap)
        out = nn.DenseGeneral(
            cfg.emb_dim, axis=(-2, -1), use_bias=False, dtype=dtype, param_dtype=pdtype,
            kernel_init=_init(cfg, ("heads", "head_dim", "embed")), name="o_proj",
        )(_tokens(out)).reshape(x.shape)
        return out, kv


def _activation(cfg: ModelConfig):
    return nn.silu if cfg.activation == "silu" else lambda h: nn.gelu(h, approximate=True)


class MLP(nn.Module):
    """Gated feed-forward: SwiGLU (silu) or GeGLU (gelu_tanh)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        dense = lambda feats, axes, name: nn.Dense(  # noqa: E731
            feats, use_bias=False, dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype),
            kernel_init=_init(cfg, axes), name=name,
        )
        act = _activation(cfg)
        tokens = _tokens(x)
        h = act(dense(cfg.mlp_dim, ("embed", "mlp"), "gate_proj")(tokens)) * dense(cfg.mlp_dim, ("embed", "mlp"), "up_proj")(tokens)
        h = nn.with_logical_constraint(h, ("batch", "mlp"))
        return dense(cfg.emb_dim, ("mlp", "embed"), "down_proj")(h).reshape(x.shape)


class MoE(nn.Module):
    """Mixture of gated experts: each token through the k experts its router picks, weighted (trainer/model/routing.py).

    Returns the output and the layer's router statistics over the `valid` [batch, seq] tokens.
    """

    cfg: ModelConfig
    mesh: jax.sharding.Mesh | None = None  # whose devices the grouped matmul is compiled for (else JAX's default)

    @nn.compact
    def __call__(self, x: Array, valid: Array) -> tuple[Array, dict[str, Array]]:
        cfg = self.cfg
        dtype, pdtype = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
        n, d, f = cfg.num_experts, cfg.emb_dim, cfg.expert_width
        tokens = _tokens(x)
        # The router in float32: its top-k is a discrete choice that bfloat16 rounding would flip.
        router = nn.Dense(n, use_bias=False, dtype=jnp.float32, param_dtype=pdtype,
                          kernel_init=_init(cfg, ("embed", None)), name="router")
        weights, experts, probs = moe.route(router(tokens), cfg.experts_per_token, cfg.router_renormalize)
        expert = lambda name, shape, axes: self.param(name, _init(cfg, axes), shape, pdtype).astype(dtype)  # noqa: E731
        params = (
            expert("gate_proj", (n, d, f), ("experts", "embed", "mlp")),
            expert("up_proj", (n, d, f), ("experts", "embed", "mlp")),
            expert("down_proj", (n, f, d), ("experts", "mlp", "embed")),
        )
        act, kept = _activation(cfg), None
        if cfg.capacity_factor:
            def constrain(a: Array, by_expert: bool) -> Array:  # see moe.with_capacity
                axes = ("batch", "experts") if by_expert else ("batch",)
                return nn.with_logical_constraint(a, axes + (None,) * (a.ndim - len(axes)))

            split = lambda a: a.reshape(*x.shape[:2], -1)  # noqa: E731
            factor = cfg.capacity_factor
            out, kept = moe.with_capacity(x, split(experts), split(weights), params, act, factor, constrain)
        else:
            platform = self.mesh.devices.flat[0].platform if self.mesh is not None else ""
            out = moe.dropless(tokens, experts, weights, params, act, platform).reshape(x.shape)
        return out.astype(dtype), moe.router_stats(experts, probs, valid, kept)


def layer_is_moe(cfg: ModelConfig) -> np.ndarray:
    """Per layer: True where its MLP is a Mixture of Experts (every moe_every-th layer of an MoE model)."""
    return (np.arange(cfg.num_layers) + 1) % cfg.moe_every == 0 if cfg.moe else np.zeros(cfg.num_layers, bool)


class Block(nn.Module):
    """Pre-norm transformer block; shaped for `nn.scan` (carry x; scanned is_global and KV cache in; cache and
    MoE router statistics out)."""

    cfg: ModelConfig
    kernel: str = "xla"
    mesh: jax.sharding.Mesh | None = None
    sparse: bool | None = None  # whether the MLP is MoE; None: cfg.moe

    @nn.compact
    def __call__(
        self, x: Array, positions: Array, masks: dict, index: Array | None, valid: Array, is_global: Array,
        kv: dict | None,
    ) -> tuple[Array, tuple[dict | None, dict]]:
        cfg = self.cfg
        attn = Attention(cfg, self.kernel, self.mesh, name="attn")
        h, kv = attn(_norm(cfg, "attn_norm")(x), positions, masks, is_global, kv, index)
        x = x + (_norm(cfg, "attn_post_norm")(h) if cfg.post_norms else h)
        stats: dict[str, Array] = {}
        if cfg.moe if self.sparse is None else self.sparse:
            h, stats = MoE(cfg, self.mesh, name="moe")(_norm(cfg, "mlp_norm")(x), valid)
        else:
            h = MLP(cfg, name="mlp")(_norm(cfg, "mlp_norm")(x))
        x = x + (_norm(cfg, "mlp_post_norm")(h) if cfg.post_norms else h)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), (kv, stats)


class Blocks(nn.Module):
    """moe_every blocks in a row, the last with an MoE MLP: the scanned unit when dense and MoE layers interleave.

    is_global and the KV cache come in with a leading axis over the group's blocks, and the cache goes out so.
    """

    cfg: ModelConfig
    kernel: str = "xla"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(
        self, x: Array, positions: Array, masks: dict, index: Array | None, valid: Array, is_global: Array,
        kv: dict | None,
    ) -> tuple[Array, tuple[dict | None, dict]]:
        n, caches = self.cfg.moe_every, []
        for j in range(n):
            block = Block(self.cfg, self.kernel, self.mesh, sparse=j == n - 1, name=f"block_{j}")
            kv_j = None if kv is None else jax.tree.map(lambda a, j=j: a[j], kv)
            x, (kv_j, stats) = block(x, positions, masks, index, valid, is_global[j], kv_j)
            caches.append(kv_j)
        return x, (None if kv is None else jax.tree.map(lambda *a: jnp.stack(a), *caches), stats)


def _masks(cfg: ModelConfig, positions: Array, segment_ids: Array | None, cache: dict | None) -> tuple[dict, Array | None]:
    """Attention masks [batch, 1, q, k] for global and/or local layers, and the cache's slot positions."""
    kinds = set(layer_is_global(cfg).tolist())
    if cache is None and not cfg.sliding_window:
        return {"global": attention_mask(segment_ids)}, None
    q_pos = positions
    if cache is None:
        k_pos = positions
        n = positions.shape[1]
        mask = jnp.tril(jnp.ones((n, n), bool))[None]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    else:  # slots up to the last new token that hold a position (left padding has none)
        k_pos = jax.lax.dynamic_update_slice(cache["pos"], positions.astype(jnp.int32), (0, cache["index"]))
        q_slot = cache["index"] + jnp.arange(positions.shape[1])
        mask = (jnp.arange(k_pos.shape[1])[None, :] <= q_slot[:, None])[None] & (k_pos >= 0)[:, None, :]
    masks = {}
    if True in kinds:
        masks["global"] = mask[:, None]
    if False in kinds:
        masks["local"] = (mask & (q_pos[:, :, None] - k_pos[:, None, :] < cfg.sliding_window))[:, None]
    return masks, (k_pos if cache is not None else None)


class Transformer(nn.Module):
    """Decoder-only LM: tokens [batch, seq] -> float32 logits [batch, seq, vocab].

    With `cache` (from `init_cache`), the tokens are written to the cache from slot cache["index"] on,
    attend to everything cached before them, and the call returns (logits, updated cache).
    An MoE model sows its router statistics per layer (moe.router_stats, over the tokens of segments > 0)
    as intermediates/moe: apply with mutable=["intermediates"] to read them.
    `attention` is the kernel of a forward pass without a cache (trainer/model/kernels.py: xla, cudnn or splash);
    splash runs per device of `mesh`.
    """

    cfg: ModelConfig
    remat: str = "none"  # a key of REMAT_POLICIES
    attention: str = "xla"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(
        self, tokens: Array, positions: Array | None = None, segment_ids: Array | None = None, cache: dict | None = None
    ) -> Array | tuple[Array, dict]:
        cfg = self.cfg
        dtype, pdtype = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        embed = nn.Embed(
            cfg.vocab_size, cfg.emb_dim, dtype=dtype, param_dtype=pdtype,
            embedding_init=_init(cfg, ("vocab", "embed")), name="embed",
        )
        x = embed(tokens)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.emb_dim), dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        if self.attention != "xla" and cache is None:
            masks, slot_pos = ({} if segment_ids is None else {"segment_ids": segment_ids}), None
        else:
            masks, slot_pos = _masks(cfg, positions, segment_ids, cache)
        group = cfg.moe_every if cfg.moe else 1  # layers per scanned unit
        unit = Block if group == 1 else Blocks
        if self.remat != "none":
            unit = nn.remat(unit, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        layers = nn.scan(
            unit, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0, 0), length=cfg.num_layers // group,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        by_unit = lambda a: a.reshape(-1, group, *a.shape[1:]) if group > 1 else a  # noqa: E731
        kv = None if cache is None else {"k": by_unit(cache["k"]), "v": by_unit(cache["v"])}
        index = None if cache is None else cache["index"]
        stack = layers(cfg, self.attention, self.mesh, name="layers")
        valid = jnp.ones(tokens.shape, bool) if segment_ids is None else segment_ids > 0
        x, (kv, stats) = stack(x, positions, masks, index, valid, by_unit(jnp.asarray(layer_is_global(cfg))), kv)
        if kv is not None and group > 1:
            kv = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), kv)
        if stats:
            self.sow("intermediates", "moe", stats)
        x = _tokens(_norm(cfg, "final_norm")(x))
        if cfg.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(
                cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=pdtype,
                kernel_init=_init(cfg, ("embed", "vocab")), name="lm_head",
            )(x)
        logits = _softcap(logits.reshape(*tokens.shape, cfg.vocab_size).astype(jnp.float32), cfg.final_softcap)
        logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
        if cache is None:
            return logits
        return logits, {**kv, "pos": slot_pos, "index": cache["index"] + tokens.shape[1]}


def param_count(params: dict) -> int:
    """Number of scalars in a parameter tree."""
    return sum(x.size for x in jax.tree_util.tree_leaves(params))
