"""Throughput accounting: FLOPs counted as MaxText does, and accelerator peaks."""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp

from configs import ModelConfig
from trainer.train.accelerators import chip_of


def train_flops_per_step(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one step on `batch` sequences (matmuls only; causal attention halved).

    An MoE layer counts its router and the k experts each token runs through (active parameters), as MaxText does.
    """
    tokens = batch * seq_len
    dense = 2 * tokens * cfg.mlp_dim * cfg.emb_dim * 3  # gate, up and down projections
    sparse = 2 * tokens * cfg.emb_dim * (cfg.expert_width * 3 * cfg.experts_per_token + cfg.num_experts)
    moe_layers = cfg.num_layers // cfg.moe_every if cfg.moe else 0
    ffn = (moe_layers * sparse + (cfg.num_layers - moe_layers) * dense) / cfg.num_layers  # per layer, on average
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
