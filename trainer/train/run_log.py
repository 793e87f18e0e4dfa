"""A training's record as it runs: each step's metrics with its throughput, one step late, as JSON lines,
TensorBoard events and progress lines; profiler traces; and periodic validation."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import jax
import numpy as np
import optax
from tensorboardX import SummaryWriter

from configs import ModelConfig, TrainSettings, UserError
from trainer.train.data import shard_paths
from trainer.train.loss import validation_loss


class MetricsLog:
    """Per-step metrics as JSON lines (and TensorBoard events), plus a readable progress line every `every` steps.

    `path` None writes no files (processes other than 0). On resume, rows after `resume_step` (steps a killed
    run logged past its last checkpoint, which the resumed run will redo) are dropped first, and TensorBoard
    hides their events (purge_step).
    """

    def __init__(
        self, path: str | Path | None, total_steps: int, every: int, log: Callable[[str], None],
        resume_step: int = 0, tensorboard_dir: str | Path | None = None,
    ):
        self.file: TextIO | None = None
        if path is not None:
            path = Path(path)
            if path.exists():
                rows = [line for line in path.read_text().splitlines() if _step_of(line) <= resume_step]
                path.write_text("".join(row + "\n" for row in rows))
            self.file = open(path, "a")
        self.events = None
        if tensorboard_dir is not None:
            # Files are named by the second they start in; the suffix keeps two from one second apart (a second
            # would truncate the first) and in the order TensorBoard must read them, by name. Events are written
            # from a thread that flushes every flush_secs.
            self.events = SummaryWriter(
                str(tensorboard_dir), purge_step=resume_step + 1, flush_secs=1, filename_suffix=f".{time.time_ns()}"
            )
        self.total, self.every, self.log = total_steps, every, log
        self.window: list[dict[str, Any]] = []  # steps since the last progress line

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step's metrics; print a progress line on the first, every `every`-th and last step."""
        if self.file is not None:
            self.file.write(json.dumps({"step": step, **metrics}) + "\n")
            self.file.flush()
        if self.events is not None:
            for tag, value in metrics.items():
                if isinstance(value, list):  # a share per expert: a histogram whose buckets are the experts
                    self.events.add_histogram_raw(
                        tag, min=0, max=len(value) - 1, num=len(value), sum=sum(i * v for i, v in enumerate(value)),
                        sum_squares=sum(i * i * v for i, v in enumerate(value)), bucket_limits=list(range(len(value))),
                        bucket_counts=value, global_step=step,
                    )
                else:
                    self.events.add_scalar(tag, value, step)
        self.window.append(metrics)
        if step == 1 or step % self.every == 0 or step == self.total or "val_loss" in metrics:
            seconds = sum(m["step_time"] for m in self.window)
            rate = lambda key: sum(m[key] * m["step_time"] for m in self.window) / seconds  # noqa: E731
            eta = seconds / len(self.window) * (self.total - step)
            self.log(
                f"step {step}/{self.total}  loss {metrics['loss']:.4f}  lr {metrics['learning_rate']:.2e}  "
                f"grad_norm {metrics['grad_norm']:.3f}  {rate('tokens_per_s'):,.0f} tok/s  "
                f"{rate('tflops_per_device'):.3f} TFLOP/s/device  MFU {100 * rate('mfu'):.1f}%  eta {eta:.0f}s"
                + (f"  val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else "")
                + (_moe_summary(metrics) if "expert_load" in metrics else "")
            )
            self.window = []

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.events is not None:
            self.events.close()


def _moe_summary(metrics: dict[str, Any]) -> str:
    """Load-balancing loss, the busiest expert's load against an even share, and the share of pairs dropped."""
    load = metrics["expert_load"]
    text = f"  balance_loss {metrics['load_balance_loss']:.3f}  busiest expert {max(load) * len(load):.2f}x even"
    return text + (f"  dropped {metrics['dropped_fraction']:.1%}" if metrics["dropped_fraction"] else "")


def _step_of(line: str) -> float:
    """The step of a metrics line; infinity for a line a killed run left half-written."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return float("inf")


class StepLog:
    """Records each step's metrics with its time, tokens/s, TFLOP/s per device and MFU.

    A step's metrics are read when the next step has been dispatched, so logging never stalls the device;
    `on_step(step, seconds)` then hears of each step done.
    """

    def __init__(
        self, metrics_log: MetricsLog, schedule: optax.Schedule, flops: float, peak: float, devices: int, tokens: int,
        on_step: Callable[[int, float], None] | None = None,
    ):
        self.metrics_log, self.schedule, self.on_step = metrics_log, schedule, on_step
        self.flops, self.peak, self.devices, self.tokens = flops, peak, devices, tokens
        self.pending: tuple[int, dict[str, Any]] | None = None
        self.restart_clock()

    def add(self, step: int, out: dict[str, jax.Array]) -> None:
        """Queue a dispatched step's metrics, recording the previous step's."""
        self.flush()
        self.pending = (step, out)

    def validate(self, loss: Callable[[Any], float], params: Any) -> None:
        """Add `loss(params)` to the queued step's metrics as val_loss, leaving its time out of the step's."""
        step, out = self.pending
        jax.block_until_ready(out)  # the step counts in its time, the validation after it does not
        start = time.perf_counter()
        self.pending = (step, {**out, "val_loss": loss(params)})
        self.tick += time.perf_counter() - start

    def flush(self) -> None:
        """Wait for the queued step's metrics and record them."""
        if self.pending is None:
            return
        (step, out), self.pending = self.pending, None
        values = {k: (v.tolist() if np.ndim(v) else float(v)) for k, v in jax.device_get(out).items()}
        now = time.perf_counter()
        seconds, self.tick = now - self.tick, now
        tflops = self.flops / seconds / self.devices / 1e12
        values.update(
            learning_rate=float(self.schedule(step - 1)), step_time=seconds, tokens_per_s=self.tokens / seconds,
            tflops_per_device=tflops, mfu=tflops * 1e12 / self.peak,
        )
        self.metrics_log.write(step, values)
        if self.on_step is not None:
            self.on_step(step, seconds)

    def restart_clock(self) -> None:
        """Time the next step from now."""
        self.tick = time.perf_counter()

    def close(self) -> None:
        self.flush()
        self.metrics_log.close()


class Profile:
    """A JAX profiler trace of `steps` steps from step `first` into `log_dir` (TensorBoard's profile plugin reads it
    from log_dir/plugins/profile/RUN/HOST.xplane.pb; every host writes its own); steps 0 = off."""

    def __init__(self, first: int, steps: int, log_dir: str | Path, resume_step: int, log: Callable[[str], None]):
        self.first, self.last, self.log_dir, self.log = first, first + steps - 1 if steps else -1, Path(log_dir), log
        self.active = False
        if steps and resume_step >= first:
            log(f"no profile: train.profile starts at step {first}, and this run resumes after step {resume_step}")

    def start(self, step: int) -> None:
        """Start tracing if `step`, about to be dispatched, is the first profiled one."""
        if step == self.first and self.last >= step:
            jax.profiler.start_trace(str(self.log_dir))
            self.active = True

    def stop(self, out: Any = None) -> None:
        """Stop tracing once `out`, the last profiled step's result, is computed."""
        if self.active:
            jax.block_until_ready(out)
            jax.profiler.stop_trace()
            self.active = False
            self.log(f"profiled steps {self.first}-{self.last} into {self.log_dir}: open it with TensorBoard's profile "
                     f"plugin or XProf")

    def __enter__(self) -> "Profile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class Validation:
    """Validation loss on the dataset's val split every `settings.eval_every` steps, when there is one."""

    def __init__(
        self, dataset_dir: str | Path, model_cfg: ModelConfig, settings: TrainSettings, batch_size: int,
        mesh: jax.sharding.Mesh, log: Callable[[str], None],
    ):
        self.model_cfg, self.every, self.batches, self.batch_size, self.mesh = (
            model_cfg, settings.eval_every, settings.eval_batches, batch_size, mesh
        )
        self.paths: list[str] = []
        # Each process would read the whole val split: in multi-process runs the eval step does validation.
        if self.every and jax.process_count() == 1:
            try:
                self.paths = shard_paths(dataset_dir, "val")
            except UserError:
                log("no val shards: no validation loss during training")

    def due(self, step: int) -> bool:
        return bool(self.paths) and step % self.every == 0

    def loss(self, params: Any) -> float:
        return validation_loss(params, self.model_cfg, self.paths, self.batch_size, self.batches, self.mesh)["loss"]
