"""Loss and gradients on data/fsdp/expert/tensor meshes of 8 devices equal the single-device result, for a dense
model and a Mixture of Experts (both ways of running its experts)."""

from __future__ import annotations

import jax
import flax.linen as nn
import numpy as np
import pytest

from configs import load_config
from tests.trainer.test_train_step import _batch
from trainer.model.decoder import Transformer
from trainer.model.sharding import RULES, batch_sharding, make_mesh
from trainer.train.loop import abstract_params, init_params, loss_and_grads

SEQ = 32


MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.load_balance_weight=0.01"]


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module")
def moe_reference():
    return _reference(*MOE)


def _reference(*overrides: str):
    """Params, a batch (with document segments) and their loss and gradients on one device."""
    model = Transformer(load_config("tiny", list(overrides)).model)
    params = jax.device_get(init_params(model, SEQ, 0, make_mesh({}, jax.devices()[:1])))
    batch = _batch(8, seed=1)
    batch["segment_ids"] = np.repeat(np.arange(1, 5), SEQ // 4)[None].repeat(8, 0).astype(np.int32)
    batch["positions"] = np.tile(np.arange(SEQ // 4), 4)[None].repeat(8, 0).astype(np.int32)
    return model, params, batch, _run(model, params, batch, {})


def _run(model: Transformer, params, batch, axes: dict[str, int]):
    mesh = make_mesh(axes, jax.devices() if axes else jax.devices()[:1])
    placed = jax.device_put(params, jax.tree.map(lambda x: x.sharding, abstract_params(model, SEQ, mesh)))
    with mesh, nn.logical_axis_rules(RULES):
        step = jax.jit(lambda p, b: loss_and_grads(model, p, b))
        out, grads = jax.device_get(step(placed, jax.device_put(batch, batch_sharding(mesh))))
        return out["loss"], grads


@pytest.mark.parametrize(
    "axes", [{"data": 8}, {"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}], ids=str
)
def test_sharded_loss_and_gradients_match_one_device(reference, axes: dict[str, int]) -> None:
    model, params, batch, (loss, grads) = reference
    loss_m, grads_m = _run(model, params, batch, axes)
    # Sharding splits the batch sums and the contractions over embed/heads/mlp into per-device partial sums
    # added in another order; float32 rounds each addition at 2^-24 relative. Measured: loss within 1 ulp,
    # gradients within 8e-7 of each leaf's largest entry; the bound leaves ~10x headroom, while a wrong
    # sharding (a missing all-reduce, a dropped shard) is off by O(1).
    np.testing.assert_allclose(loss_m, loss, rtol=1e-6)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        got = _leaf(grads_m, path)
        np.testing.assert_allclose(got, g, rtol=0, atol=1e-5 * np.abs(g).max(), err_msg=jax.tree_util.keystr(path))

def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.parametrize(
    "axes, capacity_factor",
    [({"expert": 4, "fsdp": 2}, 0.0), ({"expert": 2, "data": 2, "tensor": 2}, 0.0), ({"expert": 4, "fsdp": 2}, 2.0)],
    ids=str,
)
def test_expert_parallel_loss_and_gradients_match_one_device(moe_reference, axes, capacity_factor) -> None:
    model, params, batch, (loss, grads) = moe_reference
    # capacity_factor E / k: every expert has a slot for each token, nothing drops, the result is dropless's.
    model = model.clone(cfg=model.cfg.model_copy(update={"capacity_factor": capacity_factor}))
    loss_m, grads_m = _run(model, params, batch, axes)
    # As for the dense meshes; the objective includes the load-balancing loss, whose gradient reaches the router.
    np.testing.assert_allclose(loss_m, loss, rtol=1e-6)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        got = _leaf(grads_m, path)
        np.testing.assert_allclose(got, g, rtol=0, atol=1e-5 * np.abs(g).max(), err_msg=jax.tree_util.keystr(path))
