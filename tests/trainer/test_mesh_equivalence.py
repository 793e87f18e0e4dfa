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
from trainer.model.sharding import batch_sharding, make_mesh, use_mesh
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
    with use_mesh(mesh):
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


# The 2026 families' features on the tiny sizes: GPT-OSS (sinks, biases, YaRN, alternating windows, clamped
# SwiGLU experts with biases behind a router with a bias) and Gemma 4 MoE (wider global heads with keys as values,
# v-norm, proportional RoPE, layer scalars, a dense MLP beside the experts, the Gemma 4 router).
NEW_FAMILIES = {
    "gpt_oss": ["model.family=gpt_oss", "model.activation=silu_clamped", "model.attention_bias=true",
                "model.attention_sinks=true", "model.sliding_window=8", "model.global_every=2", "model.rope_scaling=yarn",
                "model.rope_factor=4", "model.rope_original_max_len=16", "model.rope_truncate=false", *MOE,
                "model.router_bias=true", "model.expert_bias=true"],
    "gemma4_moe": ["model.family=gemma4", "model.activation=gelu_tanh", "model.scale_embeddings=true",
                   "model.qk_norm=true", "model.v_norm=true", "model.post_norms=true", "model.layer_scalar=true",
                   "model.query_pre_attn_scalar=1", "model.sliding_window=8", "model.global_every=2",
                   "model.global_head_dim=32", "model.global_num_kv_heads=2", "model.global_k_eq_v=true",
                   "model.rope_scaling=proportional", "model.rope_fraction=0.25", "model.rope_local_theta=10000",
                   "model.final_softcap=30", "model.tie_embeddings=true", *MOE, "model.expert_mlp_dim=32",
                   "model.router=gemma4", "model.moe_dense_mlp=true"],
}


@pytest.mark.parametrize("family", list(NEW_FAMILIES))
def test_new_families_on_an_expert_fsdp_tensor_mesh_match_one_device(family) -> None:
    model, params, batch, (loss, grads) = _reference(*NEW_FAMILIES[family])
    loss_m, grads_m = _run(model, params, batch, {"expert": 2, "fsdp": 2, "tensor": 2})
    np.testing.assert_allclose(loss_m, loss, rtol=1e-6)  # tolerances as above
    # Except for Gemma 4's layer scalars: each multiplies the whole residual stream, whose every other use is
    # RMS-normed (scale-invariant), so its gradient nearly cancels (2e-8 here, against 0.1 for the largest leaf)
    # and what is left is mostly rounding of terms the size of the other gradients: its bound is 1e-2 of the
    # largest gradient's (measured 4e-9 off; a sharding bug moves it by the size of the terms).
    largest = max(np.abs(g).max() for g in jax.tree.leaves(grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        got = _leaf(grads_m, path)
        scalar = "layer_scalar" in jax.tree_util.keystr(path)
        scale = max(np.abs(g).max(), 1e-2 * largest) if scalar else np.abs(g).max()
        np.testing.assert_allclose(got, g, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
