"""Throughput accounting: FLOPs counted as MaxText does, and accelerator peaks."""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp

from configs import ModelConfig
from trainer.model.layers import head_geometry, layer_is_global, layer_is_moe
from trainer.train.accelerators import chip_of


def train_flops_per_step(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one step on `batch` sequences (matmuls only; causal attention halved, sliding-window
    layers over their window).

    An MoE layer counts its router and the k experts each token runs through (active parameters), as MaxText does,
    plus the dense MLP beside them where there is one (Gemma 4). Each layer counts its own heads (Gemma 4's global
    layers are wider).
    """
    tokens = batch * seq_len
    dense = 2 * tokens * cfg.mlp_dim * cfg.emb_dim * 3  # gate, up and down projections
    sparse = 2 * tokens * cfg.emb_dim * (cfg.expert_width * 3 * cfg.experts_per_token + cfg.num_experts)
    total = 0.0
    for is_global, is_moe in zip(layer_is_global(cfg), layer_is_moe(cfg)):
        head_dim, kv_heads, k_eq_v = head_geometry(cfg, bool(is_global))
        ffn = sparse + (dense if cfg.moe_dense_mlp else 0) if is_moe else dense
        qkv = 2 * tokens * cfg.emb_dim * (cfg.num_heads + (1 if k_eq_v else 2) * kv_heads) * head_dim
        out = 2 * tokens * cfg.emb_dim * cfg.num_heads * head_dim
        # Causal attention scores half the [seq, span] square; a local layer's span is its window (MaxText's count).
        span = seq_len if is_global or not cfg.sliding_window else min(cfg.sliding_window, seq_len)
        attention = 4 * tokens * span * cfg.num_heads * head_dim / 2
        total += ffn + qkv + out + attention
    unembed = 2 * tokens * cfg.emb_dim * cfg.vocab_size
    return 3 * (total + unembed)


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
