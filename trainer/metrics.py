"""Throughput accounting (FLOPs counted as MaxText does), accelerator peaks, and the metrics log."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import jax
import jax.numpy as jnp

from configs import ModelConfig
from trainer.accelerators import chip_of
from trainer.tensorboard import EventWriter


def train_flops_per_step(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one step on `batch` sequences (matmuls only; causal attention halved)."""
    tokens = batch * seq_len
    ffn = 2 * tokens * cfg.mlp_dim * cfg.emb_dim * 3  # gate, up and down projections
    qkv = 2 * tokens * cfg.emb_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    out = 2 * tokens * cfg.emb_dim * cfg.num_heads * cfg.head_dim
    attention = 4 * tokens * seq_len * cfg.num_heads * cfg.head_dim / 2
    unembed = 2 * tokens * cfg.emb_dim * cfg.vocab_size
    return 3 * (cfg.num_layers * (ffn + qkv + out + attention) + unembed)


def measure_matmul_flops(
    n: int = 1024, reps: int = 8, clock: Callable[[], float] = time.perf_counter, dtype: str = "float32"
) -> float:
    """FLOP/s of an n x n matmul (median of `reps`) on the default device: the peak we hold CPU runs to.

    `clock=time.process_time` gives FLOPs per CPU-second of this process, which other work on a shared
    machine disturbs far less than wall time.
    """
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(reps):
        start = clock()
        matmul(a).block_until_ready()
        times.append(clock() - start)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def peak_flops_per_device() -> tuple[float, str]:
    """Peak FLOP/s of one local device and where the number comes from."""
    device = jax.local_devices()[0]
    chip = chip_of(device)
    if chip:
        return chip.peak_flops, f"{chip.name} dense bf16 spec"
    # CPU (or an unknown chip): measure; virtual CPU devices share the same cores.
    return measure_matmul_flops() / jax.local_device_count(), f"measured f32 matmul on {device.device_kind}"


class MetricsLog:
    """Per-step metrics as JSON lines (and TensorBoard events), plus a readable progress line every `every` steps.

    `path` None writes no files (processes other than 0). On resume, rows after `resume_step` (steps a killed
    run logged past its last checkpoint, which the resumed run will redo) are dropped first.
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
        self.events = EventWriter(tensorboard_dir) if tensorboard_dir is not None else None
        self.total, self.every, self.log = total_steps, every, log
        self.window: list[dict[str, Any]] = []  # steps since the last progress line

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step's metrics; print a progress line on the first, every `every`-th and last step."""
        if self.file is not None:
            self.file.write(json.dumps({"step": step, **metrics}) + "\n")
            self.file.flush()
        if self.events is not None:
            self.events.scalars(step, metrics)
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
            )
            self.window = []

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.events is not None:
            self.events.close()


def _step_of(line: str) -> float:
    """The step of a metrics line; infinity for a line a killed run left half-written."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return float("inf")
