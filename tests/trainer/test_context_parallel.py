"""Context parallelism: load balancing reorders sequences as specified, and loss and gradients with sequences split
over the mesh's context axis (keys and values all-gathered) equal one device's, through XLA and through splash."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import UserError, load_config
from tests.trainer.test_train_step import _batch
from trainer.model.context import check_sequence, load_balance, restore_order, token_order
from trainer.model.decoder import Transformer
from trainer.model.kernels import flash_attention, xla_attention
from trainer.model.sharding import batch_sharding, make_mesh, use_mesh
from trainer.train.loop import abstract_params, init_params, loss_and_grads

SEQ = 32


@pytest.mark.parametrize("cp", [2, 4])
def test_load_balance_gives_shard_r_chunks_r_and_its_mirror(cp: int) -> None:
    rows, chunk = 3, SEQ // (2 * cp)
    batch = _batch(rows)
    balanced = jax.device_get(load_balance(batch, cp))
    index = np.arange(SEQ)
    for r, shard in enumerate(np.split(balanced["positions"], cp, axis=1)):
        mirror = 2 * cp - 1 - r
        want = np.concatenate([index[r * chunk:(r + 1) * chunk], index[mirror * chunk:(mirror + 1) * chunk]])
        np.testing.assert_array_equal(shard, np.broadcast_to(want, (rows, 2 * chunk)))
    np.testing.assert_array_equal(token_order(SEQ, cp), balanced["positions"][0])
    for name, x in batch.items():
        np.testing.assert_array_equal(balanced[name], x[:, token_order(SEQ, cp)])
        np.testing.assert_array_equal(restore_order(balanced[name], cp), x)
    given = {**batch, "positions": np.tile(np.arange(SEQ) % 5, (rows, 1))}  # positions present: reordered, not replaced
    np.testing.assert_array_equal(load_balance(given, cp)["positions"], given["positions"][:, token_order(SEQ, cp)])


def test_a_sequence_that_does_not_cut_into_two_chunks_per_shard_is_refused() -> None:
    check_sequence(32, 4)
    with pytest.raises(UserError, match="do not cut into 2 x train.mesh context = 8 equal"):
        check_sequence(36, 4)


# Plain causal; Gemma-style local (window 8) and global layers; documents with boundaries inside chunks, then padding
# (segment 0, position 0, no loss).
VARIANTS = {"causal": [], "window": ["model.sliding_window=8", "model.global_every=2"], "documents": []}


def _variant_batch(variant: str) -> dict[str, np.ndarray]:
    batch = _batch(8, seed=1)
    if variant == "documents":
        ends = np.array([5, 19, 28])
        segments = np.searchsorted(ends, np.arange(SEQ), side="right") + 1
        starts = np.concatenate([[0], ends])[segments - 1]
        segments[ends[-1]:] = 0
        batch["segment_ids"] = np.broadcast_to(segments, (8, SEQ)).astype(np.int32)
        positions = np.where(segments > 0, np.arange(SEQ) - starts, 0)
        batch["positions"] = np.broadcast_to(positions, (8, SEQ)).astype(np.int32)
        batch["mask"] = batch["mask"] * (segments > 0)
    return batch


@functools.cache
def _params(overrides: tuple[str, ...]) -> tuple:
    cfg = load_config("tiny", list(overrides)).model
    return cfg, jax.device_get(init_params(Transformer(cfg), SEQ, 0, make_mesh({}, jax.devices()[:1])))


@functools.cache
def _run(variant: str, axes: tuple[tuple[str, int], ...]) -> tuple:
    """Loss, gradients and the compiled step's HLO; on a context mesh loss_and_grads reorders the batch first."""
    cfg, params = _params(tuple(VARIANTS[variant]))
    mesh = make_mesh(dict(axes), jax.devices()[:int(np.prod([n for _, n in axes]))])
    model = Transformer(cfg, mesh=mesh)
    placed = jax.device_put(params, jax.tree.map(lambda x: x.sharding, abstract_params(model, SEQ, mesh)))
    batch = jax.device_put(_variant_batch(variant), batch_sharding(mesh))
    with use_mesh(mesh):
        step = jax.jit(lambda p, b: loss_and_grads(model, p, b)).lower(placed, batch).compile()
        out, grads = jax.device_get(step(placed, batch))
    return out["loss"], grads, step.as_text()


@pytest.mark.parametrize("variant, axes", [
    ("causal", {"context": 2}), ("window", {"fsdp": 2, "context": 2, "tensor": 2}),
    ("documents", {"data": 2, "context": 2, "tensor": 2}),
], ids=str)
def test_context_parallel_loss_and_gradients_match_one_device(variant: str, axes: dict[str, int]) -> None:
    loss, grads, _ = _run(variant, ())
    loss_cp, grads_cp, _ = _run(variant, tuple(axes.items()))
    # Reordering changes the order the token losses are summed in, and sharding splits the contractions into
    # partial sums added in another order; float32 rounds each addition at 2^-24 relative. Measured: loss within
    # 2 ulps, gradients within 1.3e-6 of each leaf's largest entry; the bounds leave ~5x headroom, while a mask by
    # index instead of position on the reordered sequence is off by O(1).
    np.testing.assert_allclose(loss_cp, loss, rtol=1e-6)
    for (path, g), g_cp in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_cp)):
        np.testing.assert_allclose(g_cp, g, rtol=0, atol=1e-5 * np.abs(g).max(), err_msg=jax.tree_util.keystr(path))


def test_the_step_all_gathers_keys_and_values_over_context() -> None:
    """On a mesh of context 2 alone every all-gather is over context: keys and values [batch, seq, kv_heads, head_dim]
    come whole to each shard (the queries stay split)."""
    *_, hlo = _run("causal", (("context", 2),))
    cfg = load_config("tiny").model
    kv_shape = f"f32[8,{SEQ},{cfg.num_kv_heads},{cfg.head_dim}]"
    gathers = re.findall(rf"= {re.escape(kv_shape)}\S* all-gather\(.*dimensions=\{{1\}}", hlo)
    assert len(gathers) >= 2, hlo  # keys and values of the scanned layer (its body appears once)


@pytest.mark.parametrize("axes, seq, window, documents", [
    ({"data": 2, "context": 2, "tensor": 2}, 256, 100, True), ({"context": 4}, 512, 0, False),
], ids=["context2+window+documents", "context4"])
def test_splash_with_context_sharding_matches_xla(axes: dict[str, int], seq: int, window: int, documents: bool) -> None:
    """Splash under shard_map with queries split over context and keys/values all-gathered, on a load-balanced
    sequence (Pallas's interpreter; 128 queries per shard, its smallest tile), against XLA's attention on the sequence
    in order: outputs and gradients."""
    heads, kv_heads, head_dim = 4, 2, 64
    mesh = make_mesh(axes, jax.devices()[:int(np.prod(list(axes.values())))])
    cp = mesh.shape["context"]
    keys = jax.random.split(jax.random.key(cp), 4)
    q = jax.random.normal(keys[0], (2, seq, heads, head_dim))
    k, v = (jax.random.normal(key, (2, seq, kv_heads, head_dim)) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape)
    segments = np.stack([np.searchsorted([50, 200], np.arange(seq), side="right")] * 2).astype(np.int32)
    i = np.arange(seq)
    mask = (i[:, None] >= i[None]) & ((i[:, None] - i[None] < window) if window else True)
    mask = mask & (segments[:, :, None] == segments[:, None, :]) if documents else np.broadcast_to(mask, (2, seq, seq))
    order = token_order(seq, cp)

    def splash(q, k, v):
        return flash_attention("splash", q, k, v, jnp.asarray(segments[:, order]) if documents else None,
                               scale=head_dim**-0.5, softcap=0.0, window=window, mesh=mesh)

    def xla(q, k, v):
        return xla_attention(q, k, v, jnp.asarray(mask[:, None]), False, head_dim**-0.5, 0.0)

    @functools.partial(jax.jit, static_argnums=0)
    def output_and_grads(attention, q, k, v, cotangent):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, *vjp(cotangent)

    want = output_and_grads(xla, q, k, v, cotangent)
    with use_mesh(mesh):
        got = output_and_grads(splash, q[:, order], k[:, order], v[:, order], cotangent[:, order])
    # Online softmax against XLA's whole rows: as test_attention.TOL (measured 1.1e-6 here).
    tol = 2e-5
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(restore_order(g, cp), w, rtol=0, atol=tol * np.abs(w).max(), err_msg=name)
