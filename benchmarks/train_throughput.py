"""Train-step throughput and MFU of Llama-shaped models; anchors: the device's peak, and a matmul measured in the same run.

    python benchmarks/train_throughput.py [--shape cpu60m|cpu_gpt_oss|cpu_gemma4|1b|8b4|gpt_oss_20b_layer,...]
        [--seq S] [--batch B] [--steps N]
        [--variants remat:dtype[:attention[:quantization]],...] [--set key=value,...]

Shapes: `cpu60m` (default, sized for a 2-core CPU): emb 512, 8 layers, 8 heads (8 kv heads) of 64, SwiGLU
mlp 1536, vocab 32000, seq 512, batch 8. `1b`: Llama 3.2 1B (emb 2048, 16 layers, 32 heads, 8 kv heads of 64,
mlp 8192, vocab 128256, tied embeddings), seq 4096, batch 4 per device. `8b4`: Llama 3 8B's layer (emb 4096,
32 heads, 8 kv heads of 128, mlp 14336, vocab 128256) with 4 layers, seq 4096, batch 2 per device.
`cpu_gpt_oss` and `cpu_gemma4` are cpu60m's sizes as the 2026 families build them, with the same active MLP
parameters (GPT-OSS: top-2 of 8 experts of 768, biases, sinks, windows of 128 on alternate layers, YaRN;
Gemma 4: 1 global layer in 4 with 128-wide heads, 2 kv heads and keys as values, v-norm, layer scalars, soft-cap).
`gpt_oss_20b_layer`: GPT-OSS 20B's layer (emb 2880, 64 heads, 8 kv heads of 64, 32 experts of 2880, top-4,
vocab 201088) with 2 layers, seq 4096, batch 1 per device (an accelerator's shape).
Several shapes, comma-separated, run in one process one after the other (the same machine, the same minute).
Float32 master weights and AdamW; `dtype` is the compute dtype; `attention` is model.attention (auto when
left out; the kernel it resolves to is printed); `quantization` is train.quantization (none | int8 | fp8; none
when left out: the layers' matmuls in 8 bits through Qwix, their FLOPs counted as float ones). Each variant is
compiled, run once to warm up, then timed over N steps of synthetic batches on one device. FLOPs are counted as
MaxText does (trainer/train/metrics.py: matmuls only, recomputation not counted).

Anchors: on a known accelerator, its dense bf16 peak from trainer/train/accelerators.py (MFU as MaxText reports
it) and a bf16 8192^2 matmul (median of 8) measured just before the variant; on CPU, float32 2048^2 matmuls measured around
each variant, both wall-clock (fastest step against the best matmul) and per CPU-second of this process,
which other work on a shared machine disturbs far less. Record the output in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import flax.linen as nn

from configs import load_config
from trainer.train.accelerators import chip_of
from trainer.train.metrics import measure_matmul_flops, train_flops_per_step
from trainer.model.decoder import param_count
from trainer.train.optimizer import make_optimizer
from trainer.model.sharding import batch_sharding, make_mesh, use_mesh
from trainer.train.loop import abstract_opt_state, abstract_params, init_opt_state, init_params, make_model, make_train_step

SHAPES = {  # model overrides, seq, batch
    "cpu60m": (["model.emb_dim=512", "model.num_layers=8", "model.num_heads=8", "model.num_kv_heads=8",
                "model.head_dim=64", "model.mlp_dim=1536", "model.vocab_size=32000"], 512, 8),
    "cpu_gpt_oss": (["model.name=tiny_gpt_oss", "model.emb_dim=512", "model.num_layers=8", "model.num_heads=8",
                     "model.num_kv_heads=8", "model.head_dim=64", "model.mlp_dim=768", "model.vocab_size=32000",
                     "model.num_experts=8", "model.experts_per_token=2", "model.sliding_window=128",
                     "model.rope_original_max_len=128"], 512, 8),
    "cpu_gemma4": (["model.name=tiny_gemma4", "model.emb_dim=512", "model.num_layers=8", "model.num_heads=8",
                    "model.num_kv_heads=8", "model.head_dim=64", "model.mlp_dim=1536", "model.vocab_size=32000",
                    "model.sliding_window=128", "model.global_every=4", "model.global_head_dim=128",
                    "model.global_num_kv_heads=2"], 512, 8),
    "gpt_oss_20b_layer": (["model.name=gpt_oss_20b", "model.num_layers=2"], 4096, 1),
    "1b": (["model.emb_dim=2048", "model.num_layers=16", "model.num_heads=32", "model.num_kv_heads=8",
            "model.head_dim=64", "model.mlp_dim=8192", "model.vocab_size=128256", "model.tie_embeddings=true",
            "model.rope_theta=500000.0"], 4096, 4),
    "8b4": (["model.emb_dim=4096", "model.num_layers=4", "model.num_heads=32", "model.num_kv_heads=8",
             "model.head_dim=128", "model.mlp_dim=14336", "model.vocab_size=128256", "model.rope_theta=500000.0"],
            4096, 2),
}


def matmul_anchor(device: jax.Device, clock=time.perf_counter) -> float:
    """FLOP/s of the matmul this device is held to: bf16 8192^2 on an accelerator, float32 2048^2 on CPU."""
    if device.platform == "cpu":
        return measure_matmul_flops(2048, clock=clock)
    return measure_matmul_flops(8192, clock=clock, dtype="bfloat16")


def run_variant(
    overrides: list[str], seq: int, batch: int, remat: str, dtype: str, attention: str, steps: int,
    quantization: str = "none", anchors: bool = True,
) -> dict:
    """Fastest and median step time, tokens/s, TFLOP/s and MFU of one variant of the model `overrides` give.

    Without `anchors` no matmul is measured (anchor_tflops, anchor_mfu and cpu_mfu are None)."""
    cfg = load_config("demo", overrides + [
        f"model.max_seq_len={seq}", f"data.seq_len={seq}", f"model.dtype={dtype}", f"model.attention={attention}",
        f"train.remat={remat}", f"train.batch_size={batch}", "train.mesh={data: 1}", f"train.quantization={quantization}",
    ])
    device = jax.devices()[0]
    mesh = make_mesh({"data": 1}, [device])
    chosen = []
    model, tx = make_model(cfg.model, cfg.train, mesh, seq, log=chosen.append), make_optimizer(cfg.train)
    params = init_params(model, seq, 0, mesh)
    opt_state = init_opt_state(tx, params, mesh)
    step = make_train_step(model, tx, 1, (abstract_params(model, seq, mesh), abstract_opt_state(tx, params, mesh)))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, seq + 1), dtype=np.int32)
    data = jax.device_put(
        {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((batch, seq), np.float32)},
        batch_sharding(mesh),
    )
    cpu = device.platform == "cpu"
    anchor, cpu_anchor = 0.0, 0.0
    if anchors:
        anchor, cpu_anchor = matmul_anchor(device), measure_matmul_flops(2048, clock=time.process_time) if cpu else 0.0
    times, cpu_times = [], []
    with use_mesh(mesh):
        start = time.perf_counter()
        params, opt_state, out = step(params, opt_state, data)
        jax.block_until_ready(out)
        compile_and_first = time.perf_counter() - start
        for _ in range(steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            params, opt_state, out = step(params, opt_state, data)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    if cpu and anchors:
        anchor = max(anchor, matmul_anchor(device))
        cpu_anchor = max(cpu_anchor, measure_matmul_flops(2048, clock=time.process_time))
    seconds, flops, chip = min(times), train_flops_per_step(cfg.model, batch, seq), chip_of(device)
    return {
        "attention": chosen[0].removeprefix("attention: "), "parameters": param_count(params),
        "first_step_s": compile_and_first, "step_s": seconds, "median_step_s": statistics.median(times),
        "tokens_per_s": batch * seq / seconds, "tflops": flops / seconds / 1e12,
        "anchor_tflops": anchor / 1e12 if anchors else None, "anchor_mfu": flops / seconds / anchor if anchors else None,
        "mfu": flops / seconds / chip.peak_flops if chip else None,
        "cpu_mfu": flops / min(cpu_times) / cpu_anchor if cpu and anchors else None, "loss": float(out["loss"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="cpu60m", help=f"one or more of {', '.join(SHAPES)}, comma-separated")
    parser.add_argument("--seq", type=int, help="sequence length (default: the shape's)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: the shape's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default="none:float32,minimal:float32,full:float32,none:bfloat16",
                        help="remat:dtype[:attention[:quantization]], comma-separated")
    parser.add_argument("--set", default="", help="extra key=value overrides for every variant, comma-separated")
    args = parser.parse_args()
    for shape in args.shape.split(","):
        run_shape(shape, args.seq, args.batch, args.steps, args.variants, [o for o in args.set.split(",") if o])


def run_shape(
    shape: str, seq: int | None, batch: int | None, steps: int, variants: str, extra: list[str] | None = None
) -> None:
    """Every variant of one shape, a line each."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    overrides, default_seq, default_batch = SHAPES[shape]
    overrides = overrides + (extra or [])
    seq, batch = seq or default_seq, batch or default_batch
    device = jax.devices()[0]
    chip = chip_of(device)
    peak = f"{chip.name} dense bf16 peak {chip.peak_flops / 1e12:.0f} TFLOP/s" if chip else "no spec peak (CPU)"
    print(f"device: {device.device_kind} (jax {jax.__version__}); shape {shape}, seq {seq}, batch {batch}; "
          f"anchors: {peak}, {'float32 2048^2' if device.platform == 'cpu' else 'bf16 8192^2'} matmul", flush=True)
    for variant in variants.split(","):
        remat, dtype, *rest = variant.split(":")
        attention, quantization = rest + ["auto", "none"][len(rest):]
        r = run_variant(overrides, seq, batch, remat, dtype, attention, steps, quantization)
        line = (f"remat={remat:<7} dtype={dtype:<8} attention={r['attention']:<6} quant={quantization:<4} "
                f"params {r['parameters'] / 1e6:7.1f} M  "
                f"first step {r['first_step_s']:6.1f} s  step {r['step_s']:7.3f} s (median {r['median_step_s']:7.3f})  "
                f"{r['tokens_per_s']:9,.0f} tok/s  {r['tflops']:7.3f} TFLOP/s  "
                f"{r['anchor_mfu']:6.1%} of the matmul's {r['anchor_tflops']:.3f}")
        if r["mfu"] is not None:
            line += f"  MFU {r['mfu']:6.1%}"
        if r["cpu_mfu"] is not None:
            line += f"  CPU-time MFU {r['cpu_mfu']:6.1%}"
        print(line + f"  loss {r['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
