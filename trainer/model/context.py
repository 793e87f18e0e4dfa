"""Context parallelism: a sequence split over the mesh's `context` axis, reordered so causal attention's work balances.

Split in order, the device holding a sequence's last tokens would attend to nearly all of it and the first to almost
nothing. Dual chunk swap (MaxText's `reorder_sequence`) cuts the sequence into 2 x cp chunks and gives context shard
r the chunks r and 2cp-1-r: an early and a late one, the same work for each shard. The loss sums over tokens, so
reordering a batch leaves it unchanged; attention masks by the tokens' positions, not their places in the array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from configs import UserError

Array = jax.Array


def check_sequence(seq_len: int, cp: int) -> None:
    """Refuse a sequence that does not cut into 2 x cp equal chunks (two per context shard)."""
    if seq_len % (2 * cp):
        raise UserError(f"sequences of {seq_len} tokens do not cut into 2 x train.mesh context = {2 * cp} equal chunks")


def chunk_order(cp: int) -> np.ndarray:
    """The original chunk at each chunk slot of a reordered sequence: 0, 2cp-1, 1, 2cp-2, ... (shard r: r, 2cp-1-r)."""
    return np.stack([np.arange(cp), 2 * cp - 1 - np.arange(cp)], axis=1).reshape(-1)


def token_order(seq_len: int, cp: int) -> np.ndarray:
    """The original index of the token at each place of a reordered sequence."""
    return np.arange(seq_len).reshape(2 * cp, -1)[chunk_order(cp)].reshape(-1)


def permute_chunks(x: Array, order: np.ndarray, axis: int = 1) -> Array:
    """x with its `axis` cut into len(order) equal chunks, chunk i of the result being chunk order[i] of x."""
    chunks = x.reshape(*x.shape[:axis], len(order), -1, *x.shape[axis + 1:])
    return jnp.take(chunks, order, axis=axis).reshape(x.shape)


def load_balance(batch: dict[str, Array], cp: int) -> dict[str, Array]:
    """A batch of [batch, seq] arrays reordered by dual chunk swap for `cp` context shards, with the tokens'
    original `positions` (added when absent: the index in the sequence)."""
    if cp == 1:
        return batch
    rows, seq = batch["inputs"].shape
    check_sequence(seq, cp)
    if "positions" not in batch:
        batch = {**batch, "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq))}
    return {name: permute_chunks(x, chunk_order(cp)) for name, x in batch.items()}


def restore_order(x: Array, cp: int, axis: int = 1) -> Array:
    """The inverse of load_balance on one array: its `axis` back in the original order."""
    return permute_chunks(x, np.argsort(chunk_order(cp)), axis)
