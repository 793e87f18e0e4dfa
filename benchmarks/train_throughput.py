"""Train-step throughput of a fixed Llama-style model; anchor: this machine's float32 matmul peak, measured in the same run.

    python benchmarks/train_throughput.py [--steps N] [--variants none:float32,minimal:float32,...]

Model: emb 512, 8 layers, 8 heads (8 kv heads) of 64, SwiGLU mlp 1536, vocab 32000, seq 512, batch 8,
float32 master weights and AdamW. Each variant (remat policy : compute dtype) is compiled, run once to
warm up, then timed over N steps of synthetic batches on one device (all cores). MFU counts FLOPs as
MaxText does (trainer/metrics.py: matmuls only, recomputation not counted). The machine is shared, so
other work steals cores at random. Two anchors, both measured around each variant: wall-clock MFU
(fastest step against the best of the matmul peaks measured just before and after) and CPU-time MFU
(FLOPs per CPU-second of this process, step against matmul), which contention disturbs far less.
Record the output in benchmarks/RESULTS.md; compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import flax.linen as nn

from configs import load_config
from trainer.metrics import measure_matmul_flops, train_flops_per_step
from trainer.model import param_count
from trainer.optimizer import make_optimizer
from trainer.sharding import RULES, batch_sharding, make_mesh
from trainer.train import init_opt_state, init_params, make_model, make_train_step, opt_state_layout, param_layout

SEQ, BATCH = 512, 8
MODEL = ["model.emb_dim=512", "model.num_layers=8", "model.num_heads=8", "model.num_kv_heads=8",
         "model.head_dim=64", "model.mlp_dim=1536", "model.vocab_size=32000", "model.max_seq_len=512"]


def run_variant(remat: str, dtype: str, steps: int) -> dict[str, float]:
    """Fastest and median step time, tokens/s and MFU of one remat/dtype variant."""
    cfg = load_config("demo", MODEL + [f"model.dtype={dtype}", f"train.remat={remat}", f"train.batch_size={BATCH}",
                                       "train.mesh={data: 1}"])
    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    model, tx = make_model(cfg.model, cfg.train), make_optimizer(cfg.train)
    params = init_params(model, SEQ, 0, mesh)
    opt_state = init_opt_state(tx, params, mesh)
    step = make_train_step(model, tx, 1, (param_layout(model, SEQ, mesh), opt_state_layout(tx, params, mesh)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (BATCH, SEQ + 1), dtype=np.int32)
    batch = jax.device_put(
        {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((BATCH, SEQ), np.float32)},
        batch_sharding(mesh),
    )
    times, cpu_times = [], []
    peak, cpu_peak = measure_matmul_flops(2048), measure_matmul_flops(2048, clock=time.process_time)
    with mesh, nn.logical_axis_rules(RULES):
        start = time.perf_counter()
        params, opt_state, out = step(params, opt_state, batch)
        jax.block_until_ready(out)
        compile_and_first = time.perf_counter() - start
        for _ in range(steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            params, opt_state, out = step(params, opt_state, batch)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    peak = max(peak, measure_matmul_flops(2048))
    cpu_peak = max(cpu_peak, measure_matmul_flops(2048, clock=time.process_time))
    seconds, cpu_seconds = min(times), min(cpu_times)
    flops = train_flops_per_step(cfg.model, BATCH, SEQ)
    return {
        "parameters": param_count(params), "first_step_s": compile_and_first, "step_s": seconds,
        "median_step_s": statistics.median(times), "peak_gflops": peak / 1e9,
        "tokens_per_s": BATCH * SEQ / seconds, "gflops": flops / seconds / 1e9, "mfu": flops / seconds / peak,
        "cpu_step_s": cpu_seconds, "cpu_mfu": flops / cpu_seconds / cpu_peak, "loss": float(out["loss"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default="none:float32,minimal:float32,full:float32,none:bfloat16")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; anchor: float32 2048^2 matmul (median of 8)")
    for variant in args.variants.split(","):
        remat, dtype = variant.split(":")
        r = run_variant(remat, dtype, args.steps)
        print(f"remat={remat:<8} dtype={dtype:<9} params {r['parameters'] / 1e6:.1f} M  first step {r['first_step_s']:6.1f} s  "
              f"step {r['step_s']:6.2f} s (median {r['median_step_s']:6.2f})  {r['tokens_per_s']:6,.0f} tok/s  "
              f"{r['gflops']:6.1f} GFLOP/s  peak {r['peak_gflops']:6.1f}  MFU {r['mfu']:6.1%}  "
              f"CPU {r['cpu_step_s']:6.2f} s/step, CPU-time MFU {r['cpu_mfu']:6.1%}  loss {r['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
