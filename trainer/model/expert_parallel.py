"""Dropless MoE under expert parallelism: each device's tokens travel to their experts' shard and back by all-to-all.

routing.dropless sorts the whole batch's (token, expert) pairs at once; under GSPMD that sort gathers every token
onto every device. Here, as MaxText's sparse_matmul does, the MoE body runs per device in `jax.shard_map`: each
device sorts its own pairs by expert and sends every shard of the `expert` axis the rows of its experts
(`jax.lax.ragged_all_to_all`); a shard groups what it received by local expert, runs one grouped matmul (its slice
of the mlp axis, summed over `tensor`) and sends the rows back, where they are unsorted and weighted.

A shard receives into a buffer of fixed size: by default the worst case (every pair it could be sent), so nothing
drops; `buffer_factor` > 0 sizes it at that many times the balanced share and drops, deterministically, the pairs
past it (the later senders' rows, each sender's higher experts first), reported as not kept.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from configs import UserError
from trainer.model import routing
from trainer.model.sharding import BATCH_AXES

Array = jax.Array


def buffer_rows(tokens: int, k: int, num_experts: int, shards: int, factor: float) -> int:
    """Rows a shard receives into, for `tokens` tokens per device: the worst case, or `factor` x the balanced share.

    Worst case: every sender's tokens all chose this shard, min(k, experts per shard) pairs each.
    """
    worst = shards * tokens * min(k, num_experts // shards)
    return worst if factor <= 0 else max(1, min(worst, math.ceil(tokens * k * factor)))


def dropless_ep(
    x: Array, experts: Array, weights: Array, params: routing.Experts, mesh: Mesh, glu: routing.Glu,
    biases: routing.Biases | None = None, platform: str = "", buffer_factor: float = 0.0,
) -> tuple[Array, Array]:
    """x [B, S, D] or [T, D], experts/weights [T, k] -> (out like x, kept [T, k]: False where a pair was dropped).

    Tokens split by batch over BATCH_AXES (and a sequence over `context`), experts over `expert`, mlp over `tensor`.
    """
    k, num_experts, shards = experts.shape[-1], params[0].shape[0], mesh.shape["expert"]
    if num_experts % shards:
        raise UserError(f"model.num_experts ({num_experts}) must be a multiple of the mesh's expert axis ({shards})")
    context = ("context",) if "context" in mesh.axis_names else ()
    rows = (BATCH_AXES, *context) if x.ndim == 3 else ((*BATCH_AXES, *context),)
    token_spec = P(*rows, None)
    up_spec, down_spec, bias_spec = P("expert", None, "tensor"), P("expert", "tensor", None), P("expert", "tensor")
    body = jax.shard_map(
        functools.partial(_per_device, glu=glu, platform=platform or mesh.devices.flat[0].platform,
                          factor=buffer_factor, shards=shards),
        mesh=mesh,
        in_specs=(token_spec, token_spec, token_spec, (up_spec, up_spec, down_spec),
                  None if biases is None else (bias_spec, bias_spec, P("expert", None))),
        out_specs=(token_spec, token_spec),
        check_vma=False,  # Qwix's quantized matmuls (train.quantization) are custom VJPs that drop the varying axes
    )
    lead = x.shape[:-1] + (k,)
    out, kept = body(x, experts.reshape(lead), weights.reshape(lead), params, biases)
    return out, kept.reshape(experts.shape)


def _per_device(
    x: Array, experts: Array, weights: Array, params: routing.Experts, biases: routing.Biases | None, *,
    glu: routing.Glu, platform: str, factor: float, shards: int,
) -> tuple[Array, Array]:
    """One device's tokens [..., D] and pairs [..., k] through the experts of the whole `expert` axis."""
    shape, d = x.shape, x.shape[-1]
    x, flat = x.reshape(-1, d), experts.reshape(-1)
    tokens, k, local = x.shape[0], experts.shape[-1], params[0].shape[0]
    me = jax.lax.axis_index("expert")

    # This device's pairs sorted by expert, so each shard's are one block; how many every sender sends every shard.
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=local * shards).astype(jnp.int32)
    all_sizes = jax.lax.all_gather(sizes, "expert")  # [sender, expert]
    wanted = all_sizes.reshape(shards, shards, local).sum(-1)  # [sender, receiver]
    buffer = buffer_rows(tokens, k, local * shards, shards, factor)
    sent = _clamp_prefix(wanted, buffer, axis=0)  # each receiver's senders in order until its buffer is full

    # Into zeros, not uninitialised memory: the padding rows run through the experts too, and a NaN there would
    # reach the weights' gradients (0 x NaN).
    dispatch = _offsets(wanted, sent, sent, me)
    received = _all_to_all(jnp.take(x, order // k, axis=0), jnp.zeros((buffer, d), x.dtype), *dispatch, platform)

    # Received rows come sender by sender, each sender's by expert: regroup them by local expert (padding last).
    from_each = jax.lax.dynamic_slice_in_dim(all_sizes, me * local, local, axis=1).reshape(-1)  # [sender x local]
    counts = _clamp_prefix(from_each, buffer, axis=0)
    block = jnp.searchsorted(jnp.cumsum(counts), jnp.arange(buffer), side="right")
    row_expert = jnp.where(block < counts.size, block % local, local)
    regroup = jnp.argsort(row_expert, stable=True)
    y = _experts(jnp.take(received, regroup, axis=0), params, biases, counts.reshape(shards, local).sum(0),
                 row_expert[regroup], glu, platform)
    y = jnp.take(y, _inverse(regroup), axis=0)

    back = _all_to_all(y, jnp.zeros((tokens * k, d), y.dtype), *_offsets(sent.T, sent.T, wanted.T, me), platform)
    out = routing.combine(jnp.take(back, _inverse(order), axis=0).reshape(tokens, k, d), weights.reshape(tokens, k))

    # A sorted pair is kept when it lies within the prefix of its receiver's block that was sent.
    receiver = jnp.take(flat, order) // local
    kept = jnp.arange(order.size) - jnp.take(dispatch[0], receiver) < jnp.take(dispatch[1], receiver)
    kept = jnp.zeros_like(kept).at[order].set(kept)
    return out.reshape(shape), kept.reshape(experts.shape)


def _experts(
    x: Array, params: routing.Experts, biases: routing.Biases | None, sizes: Array, row_expert: Array,
    glu: routing.Glu, platform: str,
) -> Array:
    """Rows x [R, D] grouped by local expert (`sizes`, padding after) -> down(glu(gate, up)), summed over `tensor`."""
    gate, up, down = params
    grouped = lambda a, w: routing.grouped_matmul(a, w, sizes, platform)  # noqa: E731
    bg, bu, bd = biases if biases is not None else (None,) * 3
    rows = lambda b: jnp.take(b, row_expert, axis=0, mode="clip")  # noqa: E731  (padding rows: the last expert's)
    add = lambda h, b: h if b is None else h + rows(b).astype(h.dtype)  # noqa: E731
    h = glu(add(grouped(x, gate), bg), add(grouped(x, up), bu))
    # Each tensor shard holds a slice of the mlp axis: the down projection's partial sums add up over it.
    return add(jax.lax.psum(grouped(h, down), "tensor"), bd)


def _clamp_prefix(sizes: Array, limit: int, axis: int) -> Array:
    """`sizes` taken in order along `axis` until their running total reaches `limit`; the rest cut off."""
    return jnp.diff(jnp.minimum(jnp.cumsum(sizes, axis=axis), limit), axis=axis, prepend=0)


def _offsets(held: Array, sent: Array, placed: Array, me: Array) -> tuple[Array, Array, Array, Array]:
    """ragged_all_to_all's input offsets, send sizes, output offsets and receive sizes on shard `me`.

    Matrices [sender, receiver]: `held` lays out each sender's buffer, `sent` says what travels, `placed` lays out
    each receiver's buffer (its rows from sender 0, then sender 1, ...).
    """
    start = lambda a, axis: jnp.cumsum(a, axis=axis) - a  # noqa: E731
    return start(held, 1)[me], sent[me], start(placed, 0)[me], sent[:, me]


def _all_to_all(
    operand: Array, output: Array, input_offsets: Array, send_sizes: Array, output_offsets: Array,
    recv_sizes: Array, platform: str,
) -> Array:
    """jax.lax.ragged_all_to_all over `expert`; on CPU, which cannot compile it, the same from a padded all_to_all."""
    if platform != "cpu":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name="expert")
    chunk = jnp.arange(min(operand.shape[0], output.shape[0]))  # no block is longer than either buffer
    source = jnp.where(chunk < send_sizes[:, None], input_offsets[:, None] + chunk, operand.shape[0])
    blocks = jnp.take(operand, source, axis=0, mode="fill", fill_value=0)  # [receiver, chunk, D]
    blocks = jax.lax.all_to_all(blocks, "expert", 0, 0)  # [sender, chunk, D]
    where = jax.lax.all_to_all(output_offsets, "expert", 0, 0)  # where each sender put its rows in mine
    target = jnp.where(chunk < recv_sizes[:, None], where[:, None] + chunk, output.shape[0])
    return output.at[target.reshape(-1)].set(blocks.reshape(-1, output.shape[-1]), mode="drop")


def _inverse(permutation: Array) -> Array:
    """The permutation that undoes `permutation`."""
    return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(permutation.size, dtype=permutation.dtype))
