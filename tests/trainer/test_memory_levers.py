"""Slice-scale levers of the train step: activation constraints that reach the compiled program, the loss in
vocabulary tiles, named remat with host offload, and the optimizer state in host memory. Each must leave the
numbers as they were."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from configs import UserError, load_config
from trainer.model.sharding import batch_sharding, make_mesh, use_mesh
from trainer.train.loop import (
    abstract_opt_state, abstract_params, compile_only, init_opt_state, init_params, loss_and_grads, make_model,
    make_train_step,
)
from trainer.train.optimizer import make_optimizer

SEQ = 32


def _batch(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, (rows, SEQ + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": (rng.random((rows, SEQ)) > 0.2).astype(np.float32)}


def _loss_grads(cfg, mesh, vocab_tiles: int = 1, params=None):
    model = make_model(cfg.model, cfg.train, mesh, SEQ, log=lambda _: None)
    params = init_params(model, SEQ, 0, mesh) if params is None else params
    with use_mesh(mesh):
        fn = jax.jit(lambda p, b: loss_and_grads(model, p, b, 1, vocab_tiles))
        out, grads = jax.device_get(fn(params, jax.device_put(_batch(8), batch_sharding(mesh))))
    return out["loss"], grads, params


def test_the_models_activation_constraints_reach_the_lowered_train_step() -> None:
    """Under the legacy `with mesh:` flax dropped every one of them (0 in the program); a regression shows here."""
    cfg = load_config("tiny", ["train.mesh={data: 2, fsdp: 2, tensor: 2}", "train.batch_size=8"])
    mesh = make_mesh(cfg.train.mesh)
    model, tx = make_model(cfg.model, cfg.train, mesh, SEQ, log=lambda _: None), make_optimizer(cfg.train)
    params = abstract_params(model, SEQ, mesh)
    opt_state = abstract_opt_state(tx, params, mesh)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding(mesh)) for k, v in _batch(8).items()}
    with use_mesh(mesh):
        text = make_train_step(model, tx, 1, (params, opt_state)).lower(params, opt_state, batch).as_text()
    # The embedding table, the embeddings, each block's output, its queries and MLP hidden (scanned: once each),
    # the logits, in the forward pass and again in the backward pass.
    assert text.count("sharding_constraint") >= 10


def test_the_loss_in_vocabulary_tiles_equals_the_whole_logits() -> None:
    cfg = load_config("tiny", ["model.tie_embeddings=true", "model.final_softcap=30.0"])
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    loss, grads, params = _loss_grads(cfg, mesh)
    loss_t, grads_t, _ = _loss_grads(cfg, mesh, vocab_tiles=4, params=params)
    # The same float32 terms summed tile by tile: a few ulps.
    np.testing.assert_allclose(loss_t, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads_t, grads)
    with pytest.raises(UserError, match="vocab_tiling"):
        _loss_grads(cfg, mesh, vocab_tiles=5, params=params)


def test_named_remat_saving_and_offloading_to_host_gives_the_same_loss_and_gradients() -> None:
    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    loss, grads, params = _loss_grads(load_config("tiny"), mesh)
    custom = load_config("tiny", ["train.remat=custom", "train.remat_save=[query_proj,key_proj,value_proj]",
                                  "train.remat_offload=[mlp_gate,mlp_up,out_proj]"])
    loss_c, grads_c, _ = _loss_grads(custom, mesh, params=params)
    # The recomputed forward is the same float32 program; XLA may fuse it differently (ulp-level).
    np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads_c, grads)
    with pytest.raises(UserError, match="the model names"):
        make_model(custom.model, load_config("tiny", ["train.remat=custom", "train.remat_save=[qkv]"]).train, mesh, SEQ)
    with pytest.raises(UserError, match="need train.remat=custom"):
        make_model(custom.model, load_config("tiny", ["train.remat_save=[query_proj]"]).train, mesh, SEQ)


def test_an_optimizer_state_in_host_memory_steps_like_one_on_device() -> None:
    cfg = load_config("tiny", ["train.mesh={fsdp: 2}"])
    mesh = make_mesh({"fsdp": 2}, jax.devices()[:2])
    batch = jax.device_put(_batch(4), batch_sharding(mesh))
    results = []
    for offload in (False, True):
        model, tx = make_model(cfg.model, cfg.train, mesh, SEQ, log=lambda _: None), make_optimizer(cfg.train)
        params = init_params(model, SEQ, 0, mesh)
        shapes = (abstract_params(model, SEQ, mesh), abstract_opt_state(tx, params, mesh, offload))
        opt_state = init_opt_state(tx, params, mesh, offload)
        with use_mesh(mesh):
            step = make_train_step(model, tx, 1, shapes)
            for _ in range(2):
                params, opt_state, out = step(params, opt_state, batch)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(opt_state) if x.ndim}
        assert kinds == {"pinned_host" if offload else "device"}
        results.append(jax.device_get((params, out["loss"])))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), *results)


def test_compile_only_shows_what_each_lever_saves() -> None:
    cfg = load_config("tiny", ["model.vocab_size=8192", "train.mesh={fsdp: 8}", "train.batch_size=8"])
    report = lambda **update: compile_only(cfg.model, cfg.train.model_copy(update=update), 256, log=lambda _: None)  # noqa: E731
    plain = report()
    assert report(vocab_tiling=8)["temp_bytes"] < plain["temp_bytes"]  # no whole [8, 256, 8192] float32 logits



def test_an_offloaded_optimizer_state_leaves_the_tpu_chips_memory() -> None:
    """XLA:CPU counts host and device memory as one; a TPU compile from this host tells them apart."""
    cfg = load_config("tiny", ["train.mesh={fsdp: 4}", "train.batch_size=8"])
    report = lambda **update: compile_only(  # noqa: E731
        cfg.model, cfg.train.model_copy(update=update), 256, log=lambda _: None, topology="v5p-8")
    plain, offloaded = report(), report(optimizer_offload=True)
    moments = 2 * 4 * plain["parameters"] // 4  # two float32 Adam moments, split 4 ways
    assert plain["host_bytes"] == 0 and offloaded["host_bytes"] >= moments
    assert offloaded["argument_bytes"] <= plain["argument_bytes"] - moments


def test_named_activations_stay_on_the_tpu_or_move_to_its_host() -> None:
    """Saving two MLP activations of each layer costs device memory over remat full; offloading them costs host
    memory instead (v5p-8, compiled from this host)."""
    cfg = load_config("tiny", ["train.mesh={fsdp: 4}", "train.batch_size=8"])
    report = lambda **update: compile_only(  # noqa: E731
        cfg.model, cfg.train.model_copy(update=update), 256, log=lambda _: None, topology="v5p-8")
    full = report(remat="full")
    saved = report(remat="custom", remat_save=["mlp_gate", "mlp_up"])
    offloaded = report(remat="custom", remat_offload=["mlp_gate", "mlp_up"])
    # Two [8 / 4 rows, 256, mlp_dim] float32 activations per layer and device (measured: exactly this on host).
    per_device = 2 * cfg.model.num_layers * (8 // 4) * 256 * cfg.model.mlp_dim * 4
    assert saved["temp_bytes"] > full["temp_bytes"] and full["host_bytes"] == saved["host_bytes"] == 0
    assert offloaded["host_bytes"] >= per_device
