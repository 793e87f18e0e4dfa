"""The decoder-only transformer: embedding, a scanned stack of blocks assembled from the layer pattern, output head.

A block is pre-norm attention then a feed-forward (a gated MLP, a Mixture of Experts, or Gemma 4's both side by
side), each optionally post-normed (Gemma 2-4), and optionally times a learned layer scalar (Gemma 4). The
blocks come from layers.unit_kinds: one `nn.scan` over units of one or more blocks. Every parameter carries
logical axis names (embed, heads, kv_heads, head_dim, mlp, vocab, experts, layers); `sharding.py` maps them onto
the device mesh. With one block per unit the tree is:

    embed/embedding                     [vocab, embed]
    layers/attn_norm/scale              [layers, embed]
    layers/attn/{q,k,v}_proj/kernel     [layers, embed, heads|kv_heads, head_dim]  (+ bias [layers, heads, head_dim])
    layers/attn/{q,k}_norm/scale        [layers, head_dim]     (qk_norm)
    layers/attn/sinks                   [layers, heads]        (attention_sinks)
    layers/attn/o_proj/kernel           [layers, heads, head_dim, embed]
    layers/attn_post_norm/scale         [layers, embed]        (post_norms)
    layers/mlp_norm/scale               [layers, embed]
    layers/mlp/{gate,up}_proj/kernel    [layers, embed, mlp]
    layers/mlp/down_proj/kernel         [layers, mlp, embed]
    layers/moe/router/kernel            [layers, embed, experts]          (MoE layers, instead of mlp)
    layers/moe/{gate,up}_proj           [layers, experts, embed, mlp]
    layers/moe/down_proj                [layers, experts, mlp, embed]
    layers/mlp_post_norm/scale          [layers, embed]        (post_norms)
    layers/layer_scalar                 [layers, 1]            (layer_scalar)
    final_norm/scale                    [embed]
    lm_head/kernel                      [embed, vocab]   (absent with tie_embeddings)

With several blocks per unit, block j's parameters sit under layers/block_{j}/, stacked over the units.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn

from configs import ModelConfig
from trainer.model.attention import Attention, masks
from trainer.model.layers import LayerKind, head_geometry, layer_is_global, unit_count, unit_kinds
from trainer.model.linears import contract
from trainer.model.mlp import MLP
from trainer.model.moe import MoE
from trainer.model.norms import norm

Array = jax.Array

# What the backward pass keeps from the forward pass of each layer (the rest is recomputed):
# none = everything, minimal = the matmul outputs, full = only the layer's input; and custom (remat_policy) = the
# activations named (jax.ad_checkpoint.checkpoint_name) in REMAT_NAMES that the run lists, on device or in host memory.
REMAT_POLICIES = {
    "none": None,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
REMAT_NAMES = ("query_proj", "key_proj", "value_proj", "attention_out", "out_proj", "mlp_gate", "mlp_up", "mlp_out")


def remat_policy(remat: str, save: Sequence[str] = (), offload: Sequence[str] = ()) -> Callable | None:
    """The checkpoint policy of `remat` (a key of REMAT_POLICIES, or custom: `save` kept on device, `offload` moved
    to host memory)."""
    if remat == "custom":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(save), names_which_can_be_offloaded=list(offload),
            offload_src="device", offload_dst="pinned_host",
        )
    return REMAT_POLICIES[remat]


def logits_of(cfg: ModelConfig, kernel: Array, x: Array) -> Array:
    """The output head: hidden states x [..., embed] times kernel [embed, vocab] -> float32 logits, soft-capped."""
    dtype = jnp.dtype(cfg.dtype)
    logits = contract(x.astype(dtype), kernel.astype(dtype), 1).astype(jnp.float32)
    if cfg.final_softcap:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


def init_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """An empty KV cache of `length` slots: keys/values per block of the scanned unit (stacked over the units),
    each slot's position (-1 = empty), the next slot."""
    dtype, units = jnp.dtype(cfg.dtype), unit_count(cfg)
    blocks = []
    for kind in unit_kinds(cfg):
        head_dim, kv_heads, _ = head_geometry(cfg, kind.is_global)
        shape = (units, batch, length, kv_heads, head_dim)
        blocks.append({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)})
    return {"kv": tuple(blocks), "pos": jnp.full((batch, length), -1, jnp.int32), "index": jnp.int32(0)}


class Block(nn.Module):
    """One pre-norm block of kind `kind`; shaped for `nn.scan` (carry x; scanned is_global and KV cache in; cache
    and MoE router statistics out)."""

    cfg: ModelConfig
    kind: LayerKind
    kernel: str = "xla"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(
        self, x: Array, positions: Array, layer_masks: dict, index: Array | None, valid: Array, is_global: Array,
        kv: dict | None,
    ) -> tuple[Array, tuple[dict | None, dict]]:
        cfg = self.cfg
        attn = Attention(cfg, self.kernel, self.mesh, self.kind.is_global, name="attn")
        h, kv = attn(norm(cfg, "attn_norm")(x), positions, layer_masks, is_global, kv, index)
        x = x + (norm(cfg, "attn_post_norm")(h) if cfg.post_norms else h)
        stats: dict[str, Array] = {}
        if not self.kind.sparse:
            h = MLP(cfg, name="mlp")(norm(cfg, "mlp_norm")(x))
        elif cfg.moe_dense_mlp:  # Gemma 4: a dense MLP and the experts side by side, each post-normed
            dense = norm(cfg, "dense_post_norm")(MLP(cfg, name="mlp")(norm(cfg, "mlp_norm")(x)))
            h, stats = MoE(cfg, self.mesh, name="moe")(norm(cfg, "moe_norm")(x), valid, router_input=x)
            h = dense + norm(cfg, "moe_post_norm")(h)
        else:
            h, stats = MoE(cfg, self.mesh, name="moe")(norm(cfg, "mlp_norm")(x), valid)
        x = x + (norm(cfg, "mlp_post_norm")(h) if cfg.post_norms else h)
        if cfg.layer_scalar:
            scalar = self.param("layer_scalar", nn.with_logical_partitioning(nn.initializers.ones, (None,)), (1,),
                                jnp.dtype(cfg.param_dtype))
            x = x * scalar.astype(x.dtype)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), (kv, stats)


class Blocks(nn.Module):
    """The blocks of one scanned unit in a row (layers.unit_kinds), block j's parameters under block_{j}.

    is_global and the KV cache come in with one entry per block, and the cache goes out so.
    """

    cfg: ModelConfig
    kernel: str = "xla"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(
        self, x: Array, positions: Array, layer_masks: dict, index: Array | None, valid: Array, is_global: Array,
        kv: tuple | None,
    ) -> tuple[Array, tuple[tuple | None, dict]]:
        caches, stats = [], {}
        for j, kind in enumerate(unit_kinds(self.cfg)):
            block = Block(self.cfg, kind, self.kernel, self.mesh, name=f"block_{j}")
            x, (kv_j, stats_j) = block(x, positions, layer_masks, index, valid, is_global[j],
                                       None if kv is None else kv[j])
            caches.append(kv_j)
            if stats_j:  # the unit's MoE blocks' statistics, summed (they are sums over tokens)
                stats = jax.tree.map(jnp.add, stats, stats_j) if stats else stats_j
        return x, (None if kv is None else tuple(caches), stats)


class Transformer(nn.Module):
    """Decoder-only LM: tokens [batch, seq] -> float32 logits [batch, seq, vocab].

    With `hidden`, it returns the final hidden states [batch, seq, embed] and the output head's kernel [embed,
    vocab] instead, for a loss that computes the logits a tile at a time (`logits_of`).

    With `cache` (from `init_cache`), the tokens are written to the cache from slot cache["index"] on,
    attend to everything cached before them, and the call returns (logits, updated cache).
    An MoE model sows its router statistics per MoE layer (routing.router_stats, over the tokens of segments > 0)
    as intermediates/moe: apply with mutable=["intermediates"] to read them.
    `attention` is the kernel of a forward pass without a cache (kernels.py: xla, cudnn or splash);
    splash runs per device of `mesh`.
    """

    cfg: ModelConfig
    remat: str = "none"  # a key of REMAT_POLICIES or custom
    remat_save: tuple[str, ...] = ()  # remat custom: names of REMAT_NAMES kept on device ...
    remat_offload: tuple[str, ...] = ()  # ... and in host memory
    attention: str = "xla"
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(
        self, tokens: Array, positions: Array | None = None, segment_ids: Array | None = None,
        cache: dict | None = None, hidden: bool = False,
    ) -> Array | tuple[Array, Array] | tuple[Array, dict]:
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        embed = nn.Embed(
            cfg.vocab_size, cfg.emb_dim, dtype=dtype, param_dtype=pdtype, name="embed",
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ("vocab", "embed")),
        )
        # Rows gathered from the table laid out by vocabulary only: from an embed-sharded table, batch-sharded ids
        # make XLA rematerialise the whole table on every device.
        table = nn.with_logical_constraint(embed.embedding, ("vocab", None))
        x = jnp.take(table.astype(dtype), tokens, axis=0)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.emb_dim), dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        if self.attention != "xla" and cache is None:
            layer_masks, slot_pos = ({} if segment_ids is None else {"segment_ids": segment_ids}), None
        else:
            layer_masks, slot_pos = masks(cfg, positions, segment_ids, cache)
        kinds = unit_kinds(cfg)
        single = len(kinds) == 1  # one block per unit: its parameters directly under layers/
        unit = Block if single else Blocks
        if self.remat != "none":
            policy = remat_policy(self.remat, self.remat_save, self.remat_offload)
            unit = nn.remat(unit, policy=policy, prevent_cse=False)
        layers = nn.scan(
            unit, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0, 0), length=unit_count(cfg),
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        block_args = (kinds[0],) if single else ()
        stack = layers(cfg, *block_args, self.attention, self.mesh, name="layers")
        is_global = jnp.asarray(layer_is_global(cfg)).reshape(unit_count(cfg), len(kinds))
        kv = None if cache is None else (cache["kv"][0] if single else cache["kv"])
        index = None if cache is None else cache["index"]
        valid = jnp.ones(tokens.shape, bool) if segment_ids is None else segment_ids > 0
        x, (kv, stats) = stack(x, positions, layer_masks, index, valid, is_global[:, 0] if single else is_global, kv)
        if stats:
            self.sow("intermediates", "moe", stats)
        x = norm(cfg, "final_norm")(x)
        kernel = embed.embedding.T if cfg.tie_embeddings else Head(cfg, name="lm_head")()
        if hidden:
            return x, kernel
        logits = nn.with_logical_constraint(logits_of(cfg, kernel, x), ("batch", "length", "vocab"))
        if cache is None:
            return logits
        return logits, {"kv": (kv,) if single else kv, "pos": slot_pos, "index": cache["index"] + tokens.shape[1]}


class Head(nn.Module):
    """The output head's kernel [embed, vocab] (untied embeddings); `logits_of` applies it."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(self.cfg.init_std), ("embed", "vocab"))
        return self.param("kernel", init, (self.cfg.emb_dim, self.cfg.vocab_size), jnp.dtype(self.cfg.param_dtype))


def param_count(params: dict) -> int:
    """Number of scalars in a parameter tree."""
    return sum(x.size for x in jax.tree_util.tree_leaves(params))
