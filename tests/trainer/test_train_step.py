"""The train step's switches (accumulation, remat, bf16), compile_only, and a training's config split and events."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import pytest

from configs import UserError, load_config
from tests.trainer.test_metrics import read_events, tensorboard_scalars
from tests.trainer.test_train_data import pack_documents, split_train, write_manifest, write_shard
from trainer.model.decoder import Transformer
from trainer.train.optimizer import make_optimizer
from trainer.model.sharding import batch_sharding, make_mesh, use_mesh
from trainer.train.loop import compile_only, init_opt_state, init_params, loss_and_grads, make_train_step, train

SEQ = 32


def _cfg(*overrides: str):
    return load_config("tiny", list(overrides))


def _batch(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, (rows, SEQ + 1), dtype=np.int32)
    mask = (rng.random((rows, SEQ)) > 0.2).astype(np.float32)  # uneven token counts per row and microbatch
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _loss_grads(model: Transformer, params, batch, mesh, accum: int = 1):
    with use_mesh(mesh):
        fn = jax.jit(lambda p, b: loss_and_grads(model, p, b, accum))
        out, grads = jax.device_get(fn(params, jax.device_put(batch, batch_sharding(mesh))))
        return out["loss"], grads


def test_gradient_accumulation_matches_the_whole_batch() -> None:
    cfg = _cfg()
    mesh = make_mesh({"data": 4, "fsdp": 2})
    model = Transformer(cfg.model)
    params = init_params(model, SEQ, 0, mesh)
    batch = _batch(16)
    loss, grads = _loss_grads(model, params, batch, mesh)
    for accum in (2, 4):  # 2: every device keeps its own rows; 4: rows move between devices
        loss_a, grads_a = _loss_grads(model, params, batch, mesh, accum)
        # Same float32 terms summed in another order: relative differences of a few ulps.
        np.testing.assert_allclose(loss_a, loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads_a, grads)


def test_remat_policies_give_the_same_loss_and_gradients() -> None:
    cfg = _cfg()
    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    params = init_params(Transformer(cfg.model), SEQ, 0, mesh)
    batch = _batch(4)
    loss, grads = _loss_grads(Transformer(cfg.model), params, batch, mesh)
    for remat in ("minimal", "full"):
        loss_r, grads_r = _loss_grads(Transformer(cfg.model, remat=remat), params, batch, mesh)
        # The recomputed forward is the same float32 program; XLA may fuse it differently (ulp-level).
        np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads_r, grads)


def test_bfloat16_compute_keeps_float32_master_weights_and_optimizer() -> None:
    cfg = _cfg()
    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    bf16 = cfg.model.model_copy(update={"dtype": "bfloat16"})
    model, tx = Transformer(bf16), make_optimizer(cfg.train)
    params = init_params(model, SEQ, 0, mesh)
    opt_state = init_opt_state(tx, params, mesh)
    batch = jax.device_put(_batch(4), batch_sharding(mesh))
    loss32, _ = _loss_grads(Transformer(cfg.model), params, batch, mesh)
    with use_mesh(mesh):
        params, opt_state, out = make_train_step(model, tx)(params, opt_state, batch)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(opt_state) if x.ndim} == {jnp.dtype("float32")}
    # bfloat16 keeps 8 significant bits (relative rounding 2^-9 per op): the loss agrees to about 1 %.
    np.testing.assert_allclose(float(out["loss"]), loss32, rtol=1e-2)


def test_compile_only_reports_memory_without_data() -> None:
    cfg = _cfg("train.mesh={fsdp: 4, tensor: 2}", "train.batch_size=16")
    plain = compile_only(cfg.model, cfg.train, 256, log=lambda _: None)
    assert plain["devices"] == 8 and plain["parameters"] > 0
    # Per device: params + two Adam moments, split 8 ways.
    assert plain["argument_bytes"] >= 3 * 4 * plain["parameters"] // 8
    full = compile_only(cfg.model, cfg.train.model_copy(update={"remat": "full"}), 256, log=lambda _: None)
    accum = compile_only(cfg.model, cfg.train.model_copy(update={"grad_accum_steps": 4}), 256, log=lambda _: None)
    assert full["temp_bytes"] < plain["temp_bytes"] and accum["temp_bytes"] < plain["temp_bytes"]
    with pytest.raises(UserError, match="grad_accum_steps"):
        compile_only(cfg.model, cfg.train.model_copy(update={"grad_accum_steps": 3}), 256, log=lambda _: None)


def test_train_on_documents_with_accumulation_remat_and_tensorboard(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    rows = [pack_documents([list(rng.integers(0, 512, n)) for n in (10, 13, 5)], SEQ) for _ in range(32)]
    write_manifest(data, SEQ, "documents")
    write_shard(data / "train-00000-of-00001.array_record", rows)
    cfg = _cfg("train.steps=4", "train.warmup_steps=1", "train.batch_size=16", "train.grad_accum_steps=2",
               "train.remat=minimal", "train.checkpoint_every=4")
    # As the pipeline calls it: a train config of the versioned fields only (train() reads no other), settings apart.
    versioned, settings = split_train(cfg.train)
    with pytest.raises(AttributeError):
        versioned.log_every  # noqa: B018
    summary = train(cfg.model, versioned, settings, data, tmp_path / "run", log=lambda _: None)
    assert summary["packing"] == "documents"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    (events_file,) = (tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*")
    assert read_events(events_file)[0].file_version == "brain.Event:2"
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert set(scalars) == set(rows[0]) - {"step"}
    for tag in ("loss", "mfu"):  # stored as float32
        assert scalars[tag] == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows]
