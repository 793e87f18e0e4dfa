"""Mixture-of-Experts routing: top-k choice of experts, the two ways of running them, the load-balancing loss.

A router's softmax over all experts picks each token's k experts (Mixtral, Qwen3-MoE, GPT-OSS, Gemma 4, as
transformers computes them); the chosen weights are optionally renormalised to sum to 1 (which equals GPT-OSS's
softmax over the top k logits). Experts are gated MLPs, optionally with biases (GPT-OSS). They then run either
- dropless: every (token, expert) pair sorted by expert and run as one grouped matmul (`jax.lax.ragged_dot` on
  GPU and TPU; on CPU, where XLA computes ragged_dot as every group over all rows, tiles of one expert each), or
- with a capacity: each sequence's pairs laid into [experts, capacity] slots, pairs past an expert's capacity
  dropped (the token keeps only its residual for that expert); slots are batched matmuls whose expert axis
  shards over the mesh's `expert` axis, so XLA moves tokens to their experts by all-to-all.
Both give the same output when nothing is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
Experts = tuple[Array, Array, Array]  # gate [E, D, F], up [E, D, F], down [E, F, D]
Biases = tuple[Array, Array, Array]  # gate [E, F], up [E, F], down [E, D]
Glu = Callable[[Array, Array], Array]  # (gate, up) -> hidden


def route(logits: Array, k: int, renormalize: bool) -> tuple[Array, Array, Array]:
    """Router logits [T, E] -> (float32 weights [T, k], expert ids [T, k], float32 probabilities [T, E])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, probs


def _expert_mlp(
    x: Array, experts: Experts, act: Callable[[Array], Array], matmul: Callable, glu: Glu | None = None,
    biases: Biases | None = None, bias_rows: Callable[[Array], Array] = lambda b: b,
) -> Array:
    """down(glu(gate(x), up(x))), glu defaulting to act(gate) * up; `bias_rows` lays an [E, F] bias out as the rows."""
    gate, up, down = experts
    add = (lambda h, b: h + bias_rows(b).astype(h.dtype)) if biases is not None else (lambda h, b: h)  # noqa: E731
    bg, bu, bd = biases if biases is not None else (None,) * 3
    glu = glu or (lambda g, u: act(g) * u)
    return add(matmul(glu(add(matmul(x, gate), bg), add(matmul(x, up), bu)), down), bd)


def grouped_matmul(x: Array, w: Array, sizes: Array, platform: str) -> Array:
    """Rows x [P, D] in groups of `sizes` [E] rows, group e times w[e] [D, F] -> [P, F], compiled for `platform`."""
    if platform != "cpu":
        return jax.lax.ragged_dot(x, w, sizes)
    # XLA:CPU's ragged_dot multiplies every row by every group's matrix (measured 9x a dense matmul of the same
    # FLOPs for 8 groups); tiles of one group each, padded, run as one batched matmul at ~1.7x.
    return _tiled_matmul(x, w, sizes, tile=max(1, min(256, x.shape[0] // w.shape[0])))


def _tiled_matmul(x: Array, w: Array, sizes: Array, tile: int) -> Array:
    """grouped_matmul as tiles of `tile` rows: each group's rows padded to whole tiles, a tile times its group's w."""
    rows, groups = x.shape[0], w.shape[0]
    tiles = rows // tile + groups  # each group wastes less than one tile
    group_end = jnp.cumsum(sizes)
    group_start = group_end - sizes
    tile_end = jnp.cumsum((sizes + tile - 1) // tile)
    tile_start = tile_end - (sizes + tile - 1) // tile
    tile_group = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(tiles), side="right"), groups - 1)
    slot = jnp.arange(tiles * tile)
    group = tile_group[slot // tile]
    offset = slot - tile_start[group] * tile  # the slot's row within its group
    source = jnp.where((offset < sizes[group]) & (slot // tile < tile_end[group]), group_start[group] + offset, rows)
    padded = jnp.concatenate([x, jnp.zeros_like(x[:1])])[source].reshape(tiles, tile, -1)
    y = jnp.einsum("ntd,ndf->ntf", padded, w[tile_group]).reshape(tiles * tile, -1)
    row = jnp.arange(rows)
    row_group = jnp.searchsorted(group_end, row, side="right")
    return y[tile_start[row_group] * tile + row - group_start[row_group]]


def dropless(
    x: Array, experts: Array, weights: Array, params: Experts, act: Callable[[Array], Array], platform: str = "",
    glu: Glu | None = None, biases: Biases | None = None,
) -> Array:
    """Every token through its k experts: x [T, D], experts/weights [T, k] -> [T, D], on `platform` (default JAX's)."""
    tokens, k = experts.shape
    num_experts = params[0].shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert, in token order within each
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    grouped = lambda a, w: grouped_matmul(a, w, sizes, platform or jax.default_backend())  # noqa: E731
    rows = lambda b: jnp.take(b, flat[order], axis=0)  # noqa: E731  (each sorted pair's expert's bias)
    y = _expert_mlp(jnp.take(x, order // k, axis=0), params, act, grouped, glu, biases, rows)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return combine(jnp.take(y, inverse, axis=0).reshape(tokens, k, -1), weights)


def combine(y: Array, weights: Array) -> Array:
    """Each token's k expert outputs y [..., k, D] weighted by weights [..., k] and summed, in float32 -> [..., D].

    A multiply and a sum, not an einsum: quantized training (trainer/model/quantization.py) rewrites the matmuls of the
    MoE layer, and this k-term weighted sum is no projection to quantize.
    """
    return jnp.sum(y.astype(jnp.float32) * weights[..., None].astype(jnp.float32), axis=-2).astype(y.dtype)


def capacity(seq_len: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert and sequence: `factor` times an even share of the sequence's token-expert pairs."""
    return max(1, math.ceil(seq_len * k * factor / num_experts))


def _slots(experts: Array, num_experts: int, slots: int) -> tuple[Array, Array]:
    """One sequence's pairs [S, k] -> each pair's slot in [E * slots] (E * slots if dropped), and whether kept.

    Pairs take an expert's slots in token order; a pair past the expert's capacity is dropped.
    """
    flat = experts.reshape(-1)
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    kept = position < slots
    return jnp.where(kept, flat * slots + position, num_experts * slots), kept


def with_capacity(
    x: Array, experts: Array, weights: Array, params: Experts, act: Callable[[Array], Array], factor: float,
    constrain: Callable[[Array, bool], Array] = lambda a, by_expert: a, glu: Glu | None = None,
    biases: Biases | None = None,
) -> tuple[Array, Array]:
    """x [B, S, D], experts/weights [B, S, k] -> ([B, S, D], kept [B, S, k]).

    `constrain(a, by_expert)` lays out an array [B, ...] by sequence (as the tokens), or slots [B, E, C, D] by
    expert (as the experts' weights): the change between the two is where tokens travel to their experts and back.
    """
    batch, seq_len, k = experts.shape
    num_experts = params[0].shape[0]
    slots = capacity(seq_len, k, num_experts, factor)
    by_sequence = lambda a: constrain(a, False)  # noqa: E731
    slot, kept = jax.vmap(lambda e: _slots(e, num_experts, slots))(by_sequence(experts))
    # Which token fills each slot (seq_len: none, a zero row), then the slots gathered: [B, E * C, D]. Indices
    # are in bounds by construction, so the gathers need no out-of-bounds masking.
    token = jnp.broadcast_to(jnp.arange(seq_len * k) // k, slot.shape)
    source = jax.vmap(lambda s, t: jnp.full(num_experts * slots + 1, seq_len).at[s].set(t))(slot, token)
    padded = by_sequence(jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1))
    buffer = jnp.take_along_axis(padded, by_sequence(source)[:, :-1, None], axis=1, mode="promise_in_bounds")
    buffer = constrain(by_sequence(buffer.reshape(batch, num_experts, slots, -1)), True)
    batched = lambda a, w: jnp.einsum("becd,edf->becf", a, w)  # noqa: E731
    slots_of = lambda b: b[None, :, None, :]  # noqa: E731  (an [E, F] bias over slots [B, E, C, F])
    y = by_sequence(constrain(_expert_mlp(buffer, params, act, batched, glu, biases, slots_of), True))
    y = by_sequence(y.reshape(batch, num_experts * slots, -1))
    y = jnp.concatenate([y, jnp.zeros_like(y[:, :1])], axis=1)  # dropped pairs read the zero slot
    y = jnp.take_along_axis(y, by_sequence(slot)[..., None], axis=1, mode="promise_in_bounds")
    return combine(by_sequence(y).reshape(batch, seq_len, k, -1), weights), kept.reshape(batch, seq_len, k)


def router_stats(experts: Array, probs: Array, valid: Array, kept: Array | None = None) -> dict[str, Array]:
    """One layer's sums over the valid tokens: pairs per expert, router probability per expert, tokens, drops."""
    valid = valid.reshape(-1).astype(jnp.float32)
    counts = jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32).sum(1)  # [T, E]
    dropped = jnp.zeros(()) if kept is None else jnp.sum(jnp.where(kept.reshape(valid.size, -1), 0.0, valid[:, None]))
    return {  # sums, not matmuls, for the same reason as in `combine`
        "counts": jnp.sum(valid[:, None] * counts, axis=0),
        "probs": jnp.sum(valid[:, None] * probs.astype(jnp.float32), axis=0),
        "tokens": jnp.sum(valid),
        "dropped": dropped,
    }


def load_balance_loss(stats: dict[str, Array]) -> Array:
    """Switch Transformer's loss over all layers' stats (stacked on a leading layer axis): E * sum_e f_e * P_e.

    f_e is the pairs routed to expert e per token, P_e the mean router probability of e, both over every
    valid token of every layer: transformers' `load_balancing_loss_func`, which is k when balanced.
    """
    tokens = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
    counts, probs = jnp.sum(stats["counts"], axis=0), jnp.sum(stats["probs"], axis=0)
    return counts.shape[-1] * jnp.sum((counts / tokens) * (probs / tokens))
