"""The train loop: sharded state on a mesh, a jitted AdamW step, Grain input, Orbax checkpoints, metrics."""

from __future__ import annotations

import json
import math
import re
import socket
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn

from configs import ModelConfig, TrainConfig, TrainSettings, UserError
from trainer.model import kernels, routing
from trainer.model.context import check_sequence, load_balance
from trainer.model.decoder import REMAT_NAMES, Transformer, param_count
from trainer.model.quantization import check_quantization, quantize
from trainer.model.sharding import BATCH_AXES, batch_sharding, logical_shardings, make_mesh, replicated, use_mesh
from trainer.params import reader as param_reader
from trainer.train import checkpoint, metrics
from trainer.train.accelerators import memory_of
from trainer.train.data import format_of, sequence_length, shard_paths, train_iterator
from trainer.train.goodput import GOODPUT_FILE, Goodput
from trainer.train.hlo import HLO_DIR, describe_memory, dump, memory_report
from trainer.train.loss import tiled_token_loss
from trainer.train.optimizer import learning_rate_schedule, make_optimizer
from trainer.train.run_log import MetricsLog, Profile, StepLog, Validation
from trainer.train.topology import slice_devices
from trainer.train.watchdog import Watchdog

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
Batch = dict[str, jax.Array]


def make_model(
    model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: jax.sharding.Mesh, seq_len: int,
    log: Callable[[str], None] = print,
) -> Transformer:
    """The model as trained: the configured rematerialisation policy and quantization, and the attention kernel for
    the mesh's devices."""
    kernel, why = kernels.choose(model_cfg.attention, model_cfg, mesh.devices.flat[0], seq_len, mesh.shape["tensor"],
                                 mesh.shape["context"])
    log(f"attention: {kernel}" + (f" ({model_cfg.attention} falls back: {why})" if why else ""))
    warning = check_quantization(train_cfg.quantization, mesh.devices.flat[0])
    if warning:
        log(f"warning: {warning}")
    unknown = set(train_cfg.remat_save + train_cfg.remat_offload) - set(REMAT_NAMES)
    if unknown:
        raise UserError(f"train.remat_save/remat_offload name {sorted(unknown)}; the model names {list(REMAT_NAMES)}")
    if (train_cfg.remat_save or train_cfg.remat_offload) and train_cfg.remat != "custom":
        raise UserError(f"train.remat_save and train.remat_offload need train.remat=custom (it is {train_cfg.remat})")
    model = Transformer(model_cfg, remat=train_cfg.remat, remat_save=tuple(train_cfg.remat_save),
                        remat_offload=tuple(train_cfg.remat_offload), attention=kernel, mesh=mesh)
    return quantize(model, train_cfg.quantization)


def _for_init(model: Transformer) -> Transformer:
    """The model to initialise params with: they do not depend on the kernel, and XLA's runs on a batch of one."""
    return model.clone(attention="xla", mesh=None)


def abstract_params(model: Transformer, seq_len: int, mesh: jax.sharding.Mesh) -> Any:
    """Shapes, dtypes and mesh shardings of the params, without allocating them."""
    boxed = jax.eval_shape(_for_init(model).init, jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
    # The boxes' values, not nn.unbox: under a mesh that would constrain the shapes, which are no arrays.
    shapes = jax.tree.map(lambda b: b.value, boxed, is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, logical_shardings(boxed, mesh)
    )


def init_params(model: Transformer, seq_len: int, seed: int, mesh: jax.sharding.Mesh) -> Any:
    """Randomly initialised params, created directly in their sharded layout."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    model = _for_init(model)
    boxed = jax.eval_shape(model.init, jax.random.key(seed), tokens)["params"]
    init = jax.jit(lambda key: nn.unbox(model.init(key, tokens)["params"]), out_shardings=logical_shardings(boxed, mesh))
    with use_mesh(mesh):
        return init(jax.random.key(seed))


def abstract_opt_state(
    tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh, offload: bool = False
) -> Any:
    """Shapes and shardings of the optimizer state: laid out like the params it tracks (in host memory with
    `offload`), scalars replicated."""
    abstract = jax.eval_shape(tx.init, params)
    kind = "pinned_host" if offload else "device"
    shardings = optax.tree_utils.tree_map_params(
        tx, lambda _, p: p.sharding.with_memory_kind(kind), abstract, params,
        transform_non_params=lambda _: replicated(mesh),
    )
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def init_opt_state(
    tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh, offload: bool = False
) -> Any:
    """The optimizer's initial state in its sharded layout (float32 moments for float32 params)."""
    return jax.jit(tx.init, out_shardings=_shardings(abstract_opt_state(tx, params, mesh, offload)))(params)


def loss_and_grads(
    model: Transformer, params: Any, batch: Batch, accum_steps: int = 1, vocab_tiles: int = 1
) -> tuple[dict[str, jax.Array], Any]:
    """Mean next-token loss over the batch's unmasked targets (and MoE router metrics), and the objective's gradient.

    Each microbatch contributes its summed loss and gradient; one division by the batch's token count at the
    end makes the result the same as the whole batch at once. Microbatch j takes rows j, j + accum_steps, ...
    so every device keeps its own rows (no data moves between devices). An MoE model's objective adds
    model.load_balance_weight times the load-balancing loss of each microbatch, weighted by its tokens.
    The logits are computed `vocab_tiles` sequence tiles at a time (loss.tiled_token_loss). On a mesh whose
    context axis splits sequences, each is first reordered so that the shards' attention work balances.
    """
    cfg = model.cfg
    if model.mesh is not None:
        batch = load_balance(batch, model.mesh.shape["context"])

    def sums(p: Any, b: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        inputs = (b["inputs"], b.get("positions"), b.get("segment_ids"))
        if not cfg.moe:
            x, kernel = model.apply({"params": p}, *inputs, hidden=True)
            total, count = tiled_token_loss(cfg, x, kernel, b["targets"], b["mask"], vocab_tiles)
            return total, {"loss": total, "count": count}
        (x, kernel), state = model.apply({"params": p}, *inputs, hidden=True, mutable=["intermediates"])
        stats = state["intermediates"]["moe"][0]
        total, count = tiled_token_loss(cfg, x, kernel, b["targets"], b["mask"], vocab_tiles)
        balance = routing.load_balance_loss(stats) * count
        return total + cfg.load_balance_weight * balance, {
            "loss": total, "count": count, "load_balance_loss": balance, "expert_pairs": jnp.sum(stats["counts"], 0),
            "dropped": jnp.sum(stats["dropped"]),
        }

    grad_fn = jax.grad(sums, has_aux=True)
    if accum_steps == 1:
        grads, totals = grad_fn(params, batch)
    else:
        def split(x: jax.Array) -> jax.Array:
            x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)
            return nn.with_logical_constraint(x, (None, "batch", "length"))

        def accumulate(carry: tuple, micro: Batch) -> tuple[tuple, None]:
            grads, micro_sums = grad_fn(params, micro)
            acc_grads, acc_sums = carry
            acc_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)
            return (acc_grads, jax.tree.map(jnp.add, acc_sums, micro_sums)), None

        micro = jax.tree.map(split, batch)
        shapes = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro))[1])
        init = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),  # f32 even for bf16 params
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        (grads, totals), _ = jax.lax.scan(accumulate, init, micro)
    count = jnp.maximum(totals.pop("count"), 1.0)
    metrics = {"loss": totals["loss"] / count}
    if cfg.moe:
        pairs = jnp.maximum(jnp.sum(totals["expert_pairs"]), 1.0)
        metrics.update(load_balance_loss=totals["load_balance_loss"] / count,
                       expert_load=totals["expert_pairs"] / pairs, dropped_fraction=totals["dropped"] / pairs)
    return metrics, jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, params)


def make_train_step(
    model: Transformer, tx: optax.GradientTransformation, accum_steps: int = 1,
    abstract_state: tuple[Any, Any] | None = None, vocab_tiles: int = 1,
) -> Callable:
    """(params, opt_state, batch) -> (params, opt_state, {loss, grad_norm, MoE metrics}); the old state is donated.

    With `abstract_state` (abstract params and optimizer state), the new state keeps exactly their shardings; an
    optimizer state kept in host memory (abstract_opt_state's `offload`) comes to the devices for the update only.
    """
    on_device = None
    if abstract_state is not None:
        on_device = jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), abstract_state[1])

    def step(params: Any, opt_state: Any, batch: Batch) -> tuple[Any, Any, dict[str, jax.Array]]:
        out, grads = loss_and_grads(model, params, batch, accum_steps, vocab_tiles)
        if on_device is not None:
            opt_state = jax.device_put(opt_state, on_device)  # a no-op unless it lives in host memory
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {**out, "grad_norm": optax.tree.norm(grads)}

    if abstract_state is None:
        return jax.jit(step, donate_argnums=(0, 1))
    params, opt_state = abstract_state
    scalars = replicated(jax.tree.leaves(params)[0].sharding.mesh)
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(_shardings(params), _shardings(opt_state), scalars))


def check_batch(train_cfg: TrainConfig, mesh: jax.sharding.Mesh, seq_len: int) -> None:
    """Refuse a batch size that the mesh's batch axes, the processes and the microbatches cannot split evenly, and
    sequences that the context axis cannot."""
    check_sequence(seq_len, mesh.shape["context"])
    shards = math.prod(mesh.shape[axis] for axis in BATCH_AXES)
    accum = train_cfg.grad_accum_steps
    if train_cfg.batch_size % (shards * accum):
        raise UserError(
            f"train.batch_size ({train_cfg.batch_size}) must be a multiple of data x fsdp x expert x "
            f"train.grad_accum_steps ({shards} x {accum} = {shards * accum})"
        )
    if train_cfg.batch_size % jax.process_count():
        raise UserError(f"train.batch_size ({train_cfg.batch_size}) must be a multiple of the {jax.process_count()} processes")


def abstract_batch(batch_size: int, seq_len: int, mesh: jax.sharding.Mesh, documents: bool = False) -> Batch:
    """Shapes and shardings of one global batch, as the train step receives it."""
    sharding = batch_sharding(mesh)
    names = ["inputs", "targets", "mask"] + (["segment_ids", "positions"] if documents else [])
    return {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32 if k == "mask" else jnp.int32, sharding=sharding)
        for k in names
    }


def compile_only(
    model_cfg: ModelConfig, train_cfg: TrainConfig, seq_len: int, log: Callable[[str], None] = print,
    documents: bool = False, topology: str = "",
) -> dict[str, Any]:
    """Lower and compile the train step from shapes alone and report per-device memory against the device's.

    With `topology` (a Cloud TPU type such as v5p-64) the step compiles for that slice, described by libtpu,
    on whatever machine this is; train.dcn_mesh then counts slices.
    """
    devices, slices = None, 1
    if topology:
        slices = math.prod(train_cfg.dcn_mesh.values())
        if slices < 0:
            raise UserError("with --topology, train.dcn_mesh gives the number of slices: sizes, not -1")
        devices = slice_devices(topology, slices)
    mesh = make_mesh(train_cfg.mesh, devices, dcn=train_cfg.dcn_mesh)
    check_batch(train_cfg, mesh, seq_len)
    model, tx = make_model(model_cfg, train_cfg, mesh, seq_len, log), make_optimizer(train_cfg)
    params = abstract_params(model, seq_len, mesh)
    opt_state = abstract_opt_state(tx, params, mesh, train_cfg.optimizer_offload)
    step = make_train_step(model, tx, train_cfg.grad_accum_steps, (params, opt_state), train_cfg.vocab_tiling)
    device = mesh.devices.flat[0]
    target = f"{mesh.size} x {device.device_kind}"
    if topology:
        target = f"{topology} ({target})" if slices == 1 else f"{slices} x {topology} ({target})"
    capacity, capacity_source = memory_of(device)
    report = {
        "target": target, "mesh": dict(mesh.shape), "devices": mesh.size, "parameters": param_count(params),
        "seq_len": seq_len, "batch_size": train_cfg.batch_size, "grad_accum_steps": train_cfg.grad_accum_steps,
        "remat": train_cfg.remat, "dtype": model_cfg.dtype, "attention": model.attention,
        "capacity_bytes_per_device": capacity,
    }
    start = time.perf_counter()
    try:
        with use_mesh(mesh):
            batch = abstract_batch(train_cfg.batch_size, seq_len, mesh, documents)
            compiled = step.lower(params, opt_state, batch).compile()
    except jax.errors.JaxRuntimeError as err:
        # XLA:TPU refuses a program over the chip's memory ("... required for HLO temporaries (400.00G) exceeds
        # available HBM (95.74G)") or over its share of host memory ("Ran out of memory in memory space host. Used
        # 204.75G of 128.00G host"). That is the answer, not a failure of the command.
        hbm = re.search(r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", str(err))
        host = re.search(r"memory space host\. Used ([\d.]+)G of ([\d.]+)G host", str(err))
        if not hbm and not host:
            raise
        needed, where = (hbm, "") if hbm else (host, " of host memory")
        report.update(fits=False, compile_seconds=time.perf_counter() - start)
        if hbm:
            report.update(peak_bytes_per_device=int(float(needed[1]) * 2**30),
                          capacity_bytes_per_device=int(float(needed[2]) * 2**30))
        else:
            report.update(host_bytes=int(float(needed[1]) * 2**30))
        log(f"{target}, mesh {dict(mesh.shape)}: does not fit, needs {needed[1]} GiB{where} of {needed[2]} GiB per "
            "device")
        return report
    report.update(memory_report(compiled, capacity), compile_seconds=time.perf_counter() - start)
    log(f"compiled the train step for {target}, mesh {dict(mesh.shape)}, in {report['compile_seconds']:.1f}s: "
        + describe_memory(report, capacity, capacity_source))
    return report


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    settings: TrainSettings,
    dataset_dir: str | Path,
    run_dir: str | Path,
    init_params_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    started: float | None = None,
) -> dict[str, Any]:
    """Train to `train_cfg.steps`, resuming from the newest checkpoint in `run_dir`; returns summary stats.

    `train_cfg` is read for the fields that change the result only; checkpointing, logging, validation,
    profiling and hang detection follow `settings`. In a multi-process run (see trainer.train.distributed) every
    process calls this; each reads its share of the data and only process 0 writes metrics. The run's wall
    time since `started` (time.time() of the process start; None = now) is accounted in goodput.json.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    primary = jax.process_index() == 0
    account = Goodput(run_dir / GOODPUT_FILE if primary else None, started, log=log)
    mesh = make_mesh(train_cfg.mesh, dcn=train_cfg.dcn_mesh)
    paths = shard_paths(dataset_dir, "train")
    fmt = format_of(paths)
    seq_len = sequence_length(paths, fmt)
    check_batch(train_cfg, mesh, seq_len)
    if seq_len > model_cfg.max_seq_len:
        raise UserError(f"the dataset's sequences ({seq_len} tokens) exceed model.max_seq_len ({model_cfg.max_seq_len})")

    model, tx = make_model(model_cfg, train_cfg, mesh, seq_len, log), make_optimizer(train_cfg)
    if model_cfg.param_dtype != "float32":
        log(f"warning: model.param_dtype={model_cfg.param_dtype} keeps master weights and Adam moments in "
            f"{model_cfg.param_dtype}; for low-precision compute set model.dtype=bfloat16 and keep param_dtype float32")
    param_shapes = abstract_params(model, seq_len, mesh)
    opt_shapes = abstract_opt_state(tx, param_shapes, mesh, train_cfg.optimizer_offload)
    data = train_iterator(
        paths, train_cfg.batch_size // jax.process_count(), train_cfg.seed, jax.process_index(), jax.process_count(), fmt
    )
    manager = checkpoint.train_checkpoints(run_dir, settings.keep_checkpoints)
    start = manager.latest_step() or 0
    account.resumed(start, run_dir / METRICS_FILE)  # steps an earlier attempt did past `start`: before MetricsLog drops them
    if start:  # restored straight into place: no initial state is built first (it would double the memory)
        with account.phase("restore"):
            params, opt_state = checkpoint.restore_train_state(manager, start, param_shapes, opt_shapes, data)
        log(f"resumed from step {start}")
    else:
        if init_params_dir:
            params = param_reader.load_params(init_params_dir, param_shapes)
            log(f"initialised from {init_params_dir}")
        else:
            params = init_params(model, seq_len, train_cfg.seed, mesh)
        opt_state = init_opt_state(tx, params, mesh, train_cfg.optimizer_offload)
    log(
        f"model {model_cfg.name}: {param_count(params):,} parameters; mesh {dict(mesh.shape)} over {mesh.size} devices "
        f"in {jax.process_count()} process(es); {fmt.packing} records of {seq_len} tokens"
    )

    flops = metrics.train_flops_per_step(model_cfg, train_cfg.batch_size, seq_len)
    peak, peak_source = metrics.peak_flops_per_device()
    log(f"{flops / 1e9:,.1f} GFLOP per step; peak {peak / 1e12:.3f} TFLOP/s per device ({peak_source})")
    sharding = batch_sharding(mesh)
    next_batch = lambda: _global_batch(next(data), sharding, train_cfg.batch_size)  # noqa: E731
    if start < train_cfg.steps:  # (a rerun of a finished training has nothing to compile)
        with account.phase("data_wait"):
            batch = next_batch()
        with use_mesh(mesh), account.phase("compile"):
            step_fn = _compile_step(
                make_train_step(model, tx, train_cfg.grad_accum_steps, (param_shapes, opt_shapes), train_cfg.vocab_tiling),
                params, opt_state,
                batch, run_dir / HLO_DIR if settings.hlo_dump and primary else None, log,
            )
    host = f" on host {jax.process_index()} ({socket.gethostname()})" if jax.process_count() > 1 else ""
    watchdog = Watchdog(settings.slow_step_factor, settings.hang_dump_seconds, settings.hang_exit_seconds, log, host,
                        start_step=start)
    metrics_log = MetricsLog(
        run_dir / METRICS_FILE if primary else None, train_cfg.steps, settings.log_every, log, resume_step=start,
        tensorboard_dir=run_dir / TENSORBOARD_DIR if primary and settings.tensorboard else None,
    )
    step_log = StepLog(
        metrics_log, learning_rate_schedule(train_cfg), flops, peak, mesh.size, train_cfg.batch_size * seq_len,
        on_step=watchdog.step_done,
    )
    validation = Validation(dataset_dir, model_cfg, settings, train_cfg.batch_size, mesh, log)
    profile = Profile(settings.profile.start, settings.profile.steps, run_dir / TENSORBOARD_DIR, start, log)
    account.begin_training()
    with use_mesh(mesh), watchdog, profile:
        for step in range(start + 1, train_cfg.steps + 1):
            if step > start + 1:
                with account.phase("data_wait"):
                    batch = next_batch()
            profile.start(step)
            params, opt_state, out = step_fn(params, opt_state, batch)
            step_log.add(step, out)
            if step == profile.last:
                step_log.flush()  # the step's own time, then the trace written outside any step's
                with watchdog.other("profile"):
                    profile.stop(out)
                step_log.restart_clock()
            if validation.due(step):
                with account.phase("validation"), watchdog.other("validation"):
                    step_log.validate(validation.loss, params)
            if step % settings.checkpoint_every == 0 or step == train_cfg.steps:
                # Saving waits for this step anyway; log it first so a checkpoint never precedes its step's row.
                step_log.flush()
                with account.phase("checkpoint"), watchdog.other("checkpoint"):
                    checkpoint.save_train_state(manager, step, params, opt_state, data)  # written in the background
                step_log.restart_clock()  # the next step's time leaves out starting the save
                account.save(step)
            elif step % settings.log_every == 0:
                account.save(step - 1)  # the newest step whose metrics row is written
        with account.phase("checkpoint"), watchdog.other("checkpoint"):
            manager.wait_until_finished()
        manager.close()
        step_log.close()
    goodput = account.finish(train_cfg.steps)
    log(account.line())
    summary = _run_summary(run_dir / METRICS_FILE, first_step=start + 2) if primary else {}
    return {
        "steps": train_cfg.steps,
        "resumed_from": start,
        "parameters": param_count(params),
        "seq_len": seq_len,
        "packing": fmt.packing,
        "tokens_per_step": train_cfg.batch_size * seq_len,
        **summary,
        **goodput,
        "peak_flops_per_device": peak,
        "peak_source": peak_source,
    }


def _compile_step(
    step: Callable, params: Any, opt_state: Any, batch: Batch, hlo_dir: Path | None, log: Callable[[str], None]
) -> jax.stages.Compiled:
    """The train step compiled ahead of time for these arguments: its memory logged, its HLO written to `hlo_dir`."""
    start = time.perf_counter()
    lowered = step.lower(params, opt_state, batch)
    compiled = lowered.compile()
    capacity, capacity_source = memory_of(jax.tree.leaves(params)[0].sharding.mesh.devices.flat[0])
    report = memory_report(compiled, capacity)
    seconds = time.perf_counter() - start
    log(f"compiled the train step in {seconds:.1f}s: " + describe_memory(report, capacity, capacity_source))
    if hlo_dir is not None:
        log(f"wrote the train step's HLO and memory report to {dump(compiled, lowered, hlo_dir, report)}")
    return compiled


def _global_batch(local: dict[str, np.ndarray], sharding: jax.sharding.Sharding, batch_size: int) -> Batch:
    """This process's rows of a batch as one global array per key."""
    # The global shape makes JAX refuse a mesh whose batch axes do not span the processes.
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:])) for k, v in local.items()}


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


def _run_summary(path: Path, first_step: int) -> dict[str, float | None]:
    """Final loss, mean loss of the last 10 steps, tokens/s and MFU from `first_step` on (no compilation), and an
    MoE's final balance."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    timed = [r for r in rows if r["step"] >= first_step] or rows[-1:]
    seconds = sum(r["step_time"] for r in timed)
    summary = {
        "final_loss": rows[-1]["loss"] if rows else None,
        "mean_loss_last_10": float(np.mean([r["loss"] for r in rows[-10:]])) if rows else None,
        "tokens_per_s": sum(r["tokens_per_s"] * r["step_time"] for r in timed) / seconds if timed else None,
        "mfu": sum(r["mfu"] * r["step_time"] for r in timed) / seconds if timed else None,
    }
    if rows and "expert_load" in rows[-1]:  # MoE: how balanced the router ended, and what capacity dropped
        load = rows[-1]["expert_load"]
        summary.update(final_load_balance_loss=rows[-1]["load_balance_loss"],
                       final_busiest_expert=max(load) * len(load),
                       mean_dropped_fraction=float(np.mean([r["dropped_fraction"] for r in rows])))
    return summary
