"""Train-step tokens/s of a Mixture of Experts against the dense model with the same active parameters, same run.

    python benchmarks/moe_throughput.py [--steps N] [--seq S] [--batch B] [--dtype float32|bfloat16]

Dense anchor (sized for a 2-core CPU): emb 512, 4 layers, 8 heads (8 kv heads) of 64, SwiGLU mlp 1536, vocab
8192. MoE: the same model with 8 experts of width 768, top-2 (Mixtral's routing), so each token runs through
2 x 768 = 1536 of expert MLP, as the dense model's; its router adds 2 * 512 * 8 FLOPs per token and layer.
Variants: dropless (sorted pairs, `jax.lax.ragged_dot`) and capacity_factor 1.25. The anchor is timed before
and after the MoE variants; each ratio is against their mean. The grouped-matmul share is the forward and
backward of the experts alone (trainer/moe.dropless on the step's pairs, jitted) times the layers, over the
step time. Record the output in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from train_throughput import run_variant  # benchmarks/ is on the path when run as a script
from trainer.model import routing as moe

DENSE = ["model.emb_dim=512", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=8", "model.head_dim=64",
         "model.mlp_dim=1536", "model.vocab_size=8192"]
MOE = DENSE + ["model.num_experts=8", "model.experts_per_token=2", "model.expert_mlp_dim=768",
               "model.load_balance_weight=0.01"]


def grouped_matmul_seconds(tokens: int, dtype: str, reps: int = 5) -> float:
    """Fastest forward + backward of one layer's experts (dropless) on `tokens` tokens routed top-2 of 8."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, 512)), dtype)
    experts = jnp.asarray(np.stack([rng.permutation(8)[:2] for _ in range(tokens)]), jnp.int32)
    weights = jnp.full((tokens, 2), 0.5, jnp.float32)
    params = tuple(jnp.asarray(rng.normal(size=s) * 0.02, dtype) for s in ((8, 512, 768), (8, 512, 768), (8, 768, 512)))
    # Routing passed as arguments: as constants XLA would fold part of the work into the compilation.
    loss = lambda x, p, e, w: jnp.sum(moe.dropless(x, e, w, p, jax.nn.silu).astype(jnp.float32))  # noqa: E731
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jax.block_until_ready(step(x, params, experts, weights))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(step(x, params, experts, weights))
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    device = jax.devices()[0]
    print(f"device: {device.device_kind} (jax {jax.__version__}); seq {args.seq}, batch {args.batch}, {args.dtype}",
          flush=True)
    run = lambda overrides: run_variant(overrides, args.seq, args.batch, "none", args.dtype, "auto", args.steps)  # noqa: E731
    results = {"dense (before)": run(DENSE)}
    results["moe dropless"] = run(MOE)
    results["moe capacity 1.25"] = run(MOE + ["model.capacity_factor=1.25"])
    results["dense (after)"] = run(DENSE)
    anchor = (results["dense (before)"]["tokens_per_s"] + results["dense (after)"]["tokens_per_s"]) / 2
    for name, r in results.items():
        print(f"{name:<18} params {r['parameters'] / 1e6:6.1f} M  step {r['step_s']:6.3f} s (median "
              f"{r['median_step_s']:6.3f})  {r['tokens_per_s']:8,.0f} tok/s  {r['tokens_per_s'] / anchor:5.2f}x dense  "
              f"{r['tflops']:6.3f} TFLOP/s  loss {r['loss']:.4f}", flush=True)
    grouped = grouped_matmul_seconds(args.seq * args.batch, args.dtype) * 4
    print(f"grouped matmuls (4 layers, forward + backward): {grouped:.3f} s = "
          f"{grouped / results['moe dropless']['step_s']:.0%} of the dropless step")


if __name__ == "__main__":
    main()
