"""The train loop: sharded state on a mesh, a jitted AdamW step, Grain input, Orbax checkpoints, metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from grain.sources import ArrayRecordDataSource

from configs import ModelConfig, TrainConfig, UserError
from trainer import checkpoint, metrics
from trainer.data import shard_paths, train_iterator
from trainer.evaluate import token_loss
from trainer.model import Transformer, param_count
from trainer.optimizer import learning_rate_schedule, make_optimizer
from trainer.sharding import RULES, batch_sharding, logical_shardings, make_mesh, replicated

METRICS_FILE = "metrics.jsonl"


def sequence_length(paths: list[str]) -> int:
    """Tokens per record of the first train shard."""
    return len(ArrayRecordDataSource(paths[:1])[0]) // 4


def param_layout(model: Transformer, seq_len: int, mesh: jax.sharding.Mesh) -> Any:
    """Shapes, dtypes and mesh shardings of the params, without allocating them."""
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed), logical_shardings(boxed, mesh)
    )


def init_params(model: Transformer, seq_len: int, seed: int, mesh: jax.sharding.Mesh) -> Any:
    """Randomly initialised params, created directly in their sharded layout."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.key(seed), tokens)["params"]
    init = jax.jit(lambda key: nn.unbox(model.init(key, tokens)["params"]), out_shardings=logical_shardings(boxed, mesh))
    # `with mesh` (not jax.set_mesh): flax.linen's logical constraints inside nn.scan need the legacy context.
    with mesh, nn.logical_axis_rules(RULES):
        return init(jax.random.key(seed))


def init_opt_state(tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh) -> Any:
    """Optimizer state laid out like the params it tracks; scalars (the step count) replicated."""
    shardings = optax.tree_utils.tree_map_params(
        tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, params), params,
        transform_non_params=lambda _: replicated(mesh),
    )
    return jax.jit(tx.init, out_shardings=shardings)(params)


def make_train_step(model: Transformer, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, {loss, grad_norm}); buffers of the old state are donated."""

    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, dict[str, jax.Array]]:
        def loss_fn(p: Any) -> jax.Array:
            logits = model.apply({"params": p}, batch["inputs"])
            total, count = token_loss(logits, batch["targets"], batch["mask"])
            return total / jnp.maximum(count, 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0, 1))


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    dataset_dir: str | Path,
    run_dir: str | Path,
    init_params_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train to `train_cfg.steps`, resuming from the newest checkpoint in `run_dir`; returns summary stats."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(train_cfg.mesh)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if train_cfg.batch_size % batch_shards:
        raise UserError(f"train.batch_size ({train_cfg.batch_size}) must be a multiple of data x fsdp ({batch_shards})")
    paths = shard_paths(dataset_dir, "train")
    seq_len = sequence_length(paths)
    if seq_len > model_cfg.max_seq_len:
        raise UserError(f"the dataset's sequences ({seq_len} tokens) exceed model.max_seq_len ({model_cfg.max_seq_len})")

    model, tx = Transformer(model_cfg), make_optimizer(train_cfg)
    if init_params_dir:
        params = checkpoint.load_params(init_params_dir, param_layout(model, seq_len, mesh))
        log(f"initialised from {init_params_dir}")
    else:
        params = init_params(model, seq_len, train_cfg.seed, mesh)
    opt_state = init_opt_state(tx, params, mesh)
    log(f"model {model_cfg.name}: {param_count(params):,} parameters; mesh {dict(mesh.shape)} over {mesh.size} devices")

    per_process_batch = train_cfg.batch_size // jax.process_count()
    data = train_iterator(paths, per_process_batch, train_cfg.seed, jax.process_index(), jax.process_count())
    manager = checkpoint.train_checkpoints(run_dir, train_cfg.keep_checkpoints)
    start = manager.latest_step() or 0
    if start:
        params, opt_state = checkpoint.restore_train_state(manager, start, _abstract(params), _abstract(opt_state), data)
        log(f"resumed from step {start}")

    flops = metrics.train_flops_per_step(model_cfg, train_cfg.batch_size, seq_len)
    peak, peak_source = metrics.peak_flops_per_device()
    log(f"{flops / 1e9:,.1f} GFLOP per step; peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})")
    schedule = learning_rate_schedule(train_cfg)
    step_fn = make_train_step(model, tx)
    sharding = batch_sharding(mesh)
    metrics_log = metrics.MetricsLog(run_dir / METRICS_FILE, train_cfg.steps, train_cfg.log_every, log)
    pending: tuple[int, dict[str, jax.Array]] | None = None
    tokens_per_step = train_cfg.batch_size * seq_len
    tick = time.perf_counter()
    with mesh, nn.logical_axis_rules(RULES):
        for step in range(start + 1, train_cfg.steps + 1):
            batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in next(data).items()}
            params, opt_state, out = step_fn(params, opt_state, batch)
            if pending:  # read the previous step's metrics now, so logging never stalls the device
                tick = _record(metrics_log, *pending, tick, schedule, flops, peak, mesh.size, tokens_per_step)
            pending = (step, out)
            if step % train_cfg.checkpoint_every == 0 or step == train_cfg.steps:
                checkpoint.save_train_state(manager, step, params, opt_state, data)
        if pending:
            tick = _record(metrics_log, *pending, tick, schedule, flops, peak, mesh.size, tokens_per_step)
    manager.wait_until_finished()
    manager.close()
    metrics_log.close()
    return {
        "steps": train_cfg.steps,
        "resumed_from": start,
        "parameters": param_count(params),
        "seq_len": seq_len,
        "tokens_per_step": tokens_per_step,
        **_run_summary(run_dir / METRICS_FILE, first_step=start + 2),
        "peak_flops_per_device": peak,
        "peak_source": peak_source,
    }


def _record(
    log: metrics.MetricsLog, step: int, out: dict[str, jax.Array], tick: float, schedule: optax.Schedule,
    flops: float, peak: float, devices: int, tokens: int,
) -> float:
    """Wait for a step's metrics, time it from the previous step's end, and log it; returns the time now."""
    values = {k: float(v) for k, v in jax.device_get(out).items()}
    now = time.perf_counter()
    seconds = now - tick
    tflops = flops / seconds / devices / 1e12
    values.update(
        learning_rate=float(schedule(step - 1)), step_time=seconds, tokens_per_s=tokens / seconds,
        tflops_per_device=tflops, mfu=tflops * 1e12 / peak,
    )
    log.write(step, values)
    return now


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _run_summary(path: Path, first_step: int) -> dict[str, float | None]:
    """Final loss, mean loss of the last 10 steps, and tokens/s and MFU from `first_step` on (no compilation)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    timed = [r for r in rows if r["step"] >= first_step] or rows[-1:]
    seconds = sum(r["step_time"] for r in timed)
    return {
        "final_loss": rows[-1]["loss"] if rows else None,
        "mean_loss_last_10": float(np.mean([r["loss"] for r in rows[-10:]])) if rows else None,
        "tokens_per_s": sum(r["tokens_per_s"] * r["step_time"] for r in timed) / seconds if timed else None,
        "mfu": sum(r["mfu"] * r["step_time"] for r in timed) / seconds if timed else None,
    }
