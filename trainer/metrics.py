"""Throughput accounting (FLOPs counted as MaxText does), accelerator peaks, and the metrics log."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import jax
import jax.numpy as jnp

from configs import ModelConfig

# Dense bf16 peak FLOP/s per chip, by a substring of jax's `device_kind`.
PEAK_FLOPS = {
    "v6 lite": 918e12, "v6e": 918e12, "v5p": 459e12, "v5 lite": 197e12, "v5e": 197e12, "v4": 275e12,
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
}


def train_flops_per_step(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one step on `batch` sequences (matmuls only; causal attention halved)."""
    tokens = batch * seq_len
    ffn = 2 * tokens * cfg.mlp_dim * cfg.emb_dim * 3  # gate, up and down projections
    qkv = 2 * tokens * cfg.emb_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    out = 2 * tokens * cfg.emb_dim * cfg.num_heads * cfg.head_dim
    attention = 4 * tokens * seq_len * cfg.num_heads * cfg.head_dim / 2
    unembed = 2 * tokens * cfg.emb_dim * cfg.vocab_size
    return 3 * (cfg.num_layers * (ffn + qkv + out + attention) + unembed)


def measure_matmul_flops(n: int = 1024, reps: int = 8) -> float:
    """FLOP/s of a float32 n x n matmul on the default device: the peak we hold CPU runs to."""
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def peak_flops_per_device() -> tuple[float, str]:
    """Peak FLOP/s of one local device and where the number comes from."""
    device = jax.local_devices()[0]
    for name, peak in PEAK_FLOPS.items():
        if name.lower() in device.device_kind.lower():
            return peak, f"{device.device_kind} bf16 spec"
    # CPU (or an unknown chip): measure; virtual CPU devices share the same cores.
    return measure_matmul_flops() / jax.local_device_count(), f"measured f32 matmul on {device.device_kind}"


class MetricsLog:
    """Per-step metrics as JSON lines, plus a readable progress line every `every` steps."""

    def __init__(self, path: str | Path, total_steps: int, every: int, log: Callable[[str], None]):
        self.file: TextIO = open(path, "a")
        self.total, self.every, self.log = total_steps, every, log
        self.start = time.perf_counter()
        self.window: list[dict[str, Any]] = []  # steps since the last progress line

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step's metrics; print a progress line on the first, every `every`-th and last step."""
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        self.window.append(metrics)
        if step == 1 or step % self.every == 0 or step == self.total:
            seconds = sum(m["step_time"] for m in self.window)
            rate = lambda key: sum(m[key] * m["step_time"] for m in self.window) / seconds  # noqa: E731
            eta = seconds / len(self.window) * (self.total - step)
            self.log(
                f"step {step}/{self.total}  loss {metrics['loss']:.4f}  lr {metrics['learning_rate']:.2e}  "
                f"grad_norm {metrics['grad_norm']:.3f}  {rate('tokens_per_s'):,.0f} tok/s  "
                f"{rate('tflops_per_device'):.3f} TFLOP/s/device  MFU {100 * rate('mfu'):.1f}%  eta {eta:.0f}s"
            )
            self.window = []

    def close(self) -> None:
        self.file.close()
