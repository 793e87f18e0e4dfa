"""The GPU check in one call: XLA flags, cuDNN attention, every family's train step, the 1B shape's MFU, 8-bit
training and dropless MoE, each figure against an anchor measured in the same run; prints RESULTS.md's table.

On one H100 through the device tool (under 8 minutes), from the project root:
    bash ../shared/gpu/fetch-wheels.sh        (once: the wheels the GPU image lacks, into .whl/)
    run(carry=[".whl"], command="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1;
        PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py")
On CPU (tiny shapes, one variant of each part, cuDNN skipped):  python benchmarks/gpu_check.py --cpu
Each part that fails prints one row "FAILED: <error>" and the rest go on; past --budget seconds the remaining
train-step variants are skipped (rerun those with --parts).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.train import xla_flags  # noqa: E402  (imports no JAX: flags go in before JAX starts)

Row = tuple[str, str, str, str]  # check, result, anchor, ratio or verdict
FAMILIES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "models").glob("tiny*.yml"))
TOLERANCE = 0.03  # max |cuDNN - XLA| / max |XLA|: about 4 bf16 ulps (2^-8) of two kernels that sum in other orders
# Part -> method. XLA attention on the 1B shape comes last: without remat it may not fit, and it is the slowest.
PARTS = {"attention": "attention", "families": "families", "1b": "one_b_cudnn", "quantization": "quantization",
         "moe": "moe", "1b_xla": "one_b_xla", "goal": "goal"}
MIXTRAL_SMALL = ["model.name=tiny_mixtral", "model.emb_dim=1024", "model.num_layers=4", "model.num_heads=16",
                 "model.num_kv_heads=8", "model.head_dim=64", "model.mlp_dim=3584", "model.vocab_size=32000",
                 "model.num_experts=8", "model.experts_per_token=2", "model.sliding_window=0"]
# attention: (batch, seq, heads, kv heads, head_dim, window); family: (seq, batch); moe: (overrides, seq, batch)
GPU = {"attention": (2, 4096, 32, 8, 64, 1024), "family": (256, 4), "moe": (MIXTRAL_SMALL, 4096, 2), "steps": 3}
CPU = {"attention": (1, 128, 4, 2, 16, 32), "family": (64, 2), "moe": (["model.name=tiny_mixtral"], 32, 2), "steps": 1}

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", "--quick", action="store_true",
                        help="tiny shapes on CPU, one variant of each part, compiled without LLVM optimisation")
    parser.add_argument("--budget", type=float, default=360, help="seconds after which the remaining variants are skipped")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}, in this order")
    args = parser.parse_args()
    if args.cpu:  # a smoke test of the code: compile time is all that counts
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    rows = [flags_row(args.cpu)]
    print(" / ".join(rows[0]), flush=True)
    check = Check(args.cpu, args.budget)
    for part in args.parts.split(","):
        check.run(part, getattr(check, PARTS[part]))
    print("\n| check | result | anchor | ratio |\n|---|---|---|---|")
    for row in rows + check.rows:
        print(f"| {' | '.join(row)} |")


def flags_row(cpu: bool) -> Row:
    """Set the default XLA flags this jax's CUDA plugin takes (each checked in a fresh process); CPU sets none."""
    platform = "cpu" if cpu else xla_flags.detect_platform()
    if platform != "gpu":
        return ("XLA flags", xla_flags.apply(platform=platform), "", "")
    refused, error = xla_flags.rejected(xla_flags.flags("gpu"), "cuda")
    line = xla_flags.apply(drop=refused)
    verdict = f"refused: {', '.join(refused)} ({error[-120:]})" if refused else "all accepted by the CUDA plugin"
    return ("XLA flags", line.replace("|", "/"), f"{len(xla_flags.flags('gpu'))} defaults", verdict)


class Check:
    """The parts of the check, each appending rows; one that raises becomes a FAILED row."""

    def __init__(self, cpu: bool, budget: float) -> None:
        import jax

        self.cpu, self.budget, self.start = cpu, budget, time.perf_counter()
        self.sizes = CPU if cpu else GPU
        self.rows: list[Row] = []
        self.results: dict[str, dict] = {}
        self.cache: dict[tuple, dict] = {}  # the same variant under two names runs once
        device = jax.devices()[0]
        self.nvidia = device.platform == "gpu" and "nvidia" in device.device_kind.lower()
        print(f"device: {device.device_kind} (jax {jax.__version__})", flush=True)

    def add(self, *row: str) -> None:
        self.rows.append(row)
        print(f"[{time.perf_counter() - self.start:5.0f} s] {' / '.join(c for c in row if c)}", flush=True)

    def run(self, name: str, part: Callable[[], None]) -> None:
        try:
            part()
        except Exception as err:  # one broken part must not lose the others' rows
            self.add(name, f"FAILED: {one_line(err)}", "", "")

    def variant(self, name: str, overrides: list[str], seq: int, batch: int, remat: str = "none",
                dtype: str = "bfloat16", attention: str = "auto", quantization: str = "none", anchors: bool = True,
                ) -> dict | None:
        """One train step variant (train_throughput.run_variant), kept by name; None (and a row) if skipped or failed."""
        from train_throughput import run_variant

        if time.perf_counter() - self.start > self.budget:
            self.add(name, f"SKIPPED: past the {self.budget:.0f} s budget", "", "")
            return None
        key = (tuple(overrides), seq, batch, remat, dtype, attention, quantization)
        try:
            if key not in self.cache:
                self.cache[key] = run_variant(overrides, seq, batch, remat, dtype, attention, self.sizes["steps"],
                                              quantization, anchors and not self.cpu)  # CPU anchors take seconds
        except Exception as err:
            self.add(name, f"FAILED: {one_line(err)}", "", "")
            return None
        self.results[name] = self.cache[key]
        return self.results[name]

    def attention(self) -> None:
        """cuDNN flash attention against XLA's: outputs, gradients and fwd+bwd time, causal, windowed, documents."""
        if not self.nvidia:
            for case in ("causal", "window", "documents"):
                self.add(f"cuDNN attention, {case}", "SKIPPED: needs an NVIDIA GPU", "XLA attention", "")
            return
        for case in ("causal", "window", "documents"):
            try:
                self.add(*attention_row(case, *self.sizes["attention"]))
            except Exception as err:
                self.add(f"cuDNN attention, {case}", f"FAILED: {one_line(err)}", "XLA attention", "")

    def families(self) -> None:
        """A few train steps of every tiny model: the loss finite and near a random model's, ln(vocab)."""
        seq, batch = self.sizes["family"]
        for i, family in enumerate(FAMILIES):
            name = f"train step, {family}"
            if self.cpu and i:
                self.add(name, "SKIPPED: --cpu steps one family", "", "")
                continue
            attention = "auto" if self.nvidia else "xla"  # (what auto is on CPU: the 1B stand-in's same step)
            r = self.variant(name, [f"model.name={family}"], seq, batch, attention=attention, anchors=False)
            if r:
                vocab = 512  # every tiny model's
                ok = "ok" if math.isfinite(r["loss"]) else "FAILED: loss not finite"
                self.add(name, f"loss {r['loss']:.3f}, attention {r['attention']}, {r['tokens_per_s']:,.0f} tok/s",
                         f"ln(vocab) {math.log(vocab):.3f}", f"{r['loss'] / math.log(vocab):.2f}x, {ok}")

    def one_b_cudnn(self) -> None:
        """The 1B shape at seq 4096 with cuDNN attention (XLA's on CPU): tokens/s and MFU under each remat policy."""
        self.one_b("xla" if self.cpu else "cudnn", ["none"] if self.cpu else ["none", "minimal", "full"])

    def one_b_xla(self) -> None:
        """The 1B shape with XLA attention under each remat policy, and cuDNN's speed-up over it."""
        if self.cpu:
            self.add("1B, xla attention", "SKIPPED: --cpu ran it as the 1B stand-in above", "", "")
            return
        self.one_b("xla", ["full", "minimal", "none"])
        for remat in ("none", "minimal", "full"):
            cudnn, xla = (self.results.get(f"1B, {a} attention, remat {remat}") for a in ("cudnn", "xla"))
            if cudnn and xla:
                self.add(f"1B cuDNN / XLA attention, remat {remat}", f"{cudnn['tokens_per_s']:,.0f} tok/s",
                         f"XLA {xla['tokens_per_s']:,.0f} tok/s", f"{cudnn['tokens_per_s'] / xla['tokens_per_s']:.2f}x")

    def one_b(self, attention: str, remats: list[str]) -> None:
        overrides, seq, batch = self.shape()
        for remat in remats:
            name = f"1B, {attention} attention, remat {remat}"
            r = self.variant(name, overrides, seq, batch, remat, "bfloat16", attention)
            if r:
                self.add(name, f"{r['tokens_per_s']:,.0f} tok/s, {mfu(r)}", anchor(r), "")

    def quantization(self) -> None:
        """int8 and fp8 training (Qwix) against bf16 on the 1B shape, same attention and remat."""
        overrides, seq, batch = self.shape()
        attention, remat = ("xla", "none") if self.cpu else ("cudnn", "full")
        base = self.variant(f"1B, {attention} attention, remat {remat}", overrides, seq, batch, remat, "bfloat16",
                            attention)  # measured already by the 1b part, unless --parts left it out
        for quant in ("int8", "fp8"):
            name = f"1B {quant}, {attention} attention, remat {remat}"
            r = self.variant(name, overrides, seq, batch, remat, "bfloat16", attention, quant)
            if r and base:
                goal = " (goal >= 1.2x)" if quant == "fp8" else ""
                self.add(name, f"{r['tokens_per_s']:,.0f} tok/s", f"bf16 {base['tokens_per_s']:,.0f} tok/s",
                         f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x{goal}")

    def moe(self) -> None:
        """Dropless MoE (ragged_dot) against capacity factor 1.25 on a small Mixtral-like model."""
        overrides, seq, batch = self.sizes["moe"]
        dropless = self.variant("MoE dropless", overrides, seq, batch, anchors=False)
        capacity = self.variant("MoE capacity 1.25", overrides + ["model.capacity_factor=1.25"], seq, batch, anchors=False)
        if dropless and capacity:
            self.add("MoE dropless (ragged_dot), Mixtral-like", f"{dropless['tokens_per_s']:,.0f} tok/s",
                     f"capacity 1.25: {capacity['tokens_per_s']:,.0f} tok/s",
                     f"{dropless['tokens_per_s'] / capacity['tokens_per_s']:.2f}x")

    def goal(self) -> None:
        """The best bf16 MFU of the 1B shape against the goal, 45 %."""
        measured = {k: r for k, r in self.results.items() if k.startswith("1B, ") and r.get("mfu") is not None}
        if not measured:
            self.add("goal: >= 45 % MFU, bf16 1B seq 4096", "no MFU (no known accelerator, or every variant failed)", "", "")
            return
        name, best = max(measured.items(), key=lambda kv: kv[1]["mfu"])
        self.add("goal: >= 45 % MFU, bf16 1B seq 4096", f"{best['mfu']:.1%} ({name.removeprefix('1B, ')})",
                 "989 TFLOP/s", "met" if best["mfu"] >= 0.45 else "not met")

    def shape(self) -> tuple[list[str], int, int]:
        from train_throughput import SHAPES

        return (["model.name=tiny"], *self.sizes["family"]) if self.cpu else SHAPES["1b"]


def attention_row(case: str, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, window: int) -> Row:
    """cuDNN against XLA attention on one case: the largest output and gradient difference, and the speed ratio."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer.model.attention import attention_mask
    from trainer.model.kernels import flash_attention, xla_attention

    rng = np.random.default_rng(0)
    q, k, v, cotangent = (jnp.asarray(rng.normal(size=(batch, seq, h, head_dim)), jnp.bfloat16)
                          for h in (heads, kv_heads, kv_heads, heads))
    segments = None
    if case == "documents":
        cuts = np.sort(rng.choice(np.arange(1, seq), 3, replace=False))
        segments = jnp.asarray(np.broadcast_to(np.searchsorted(cuts, np.arange(seq), side="right"), (batch, seq)))
    width = window if case == "window" else 0
    mask = attention_mask(segments)
    if width:
        pos = jnp.arange(seq)
        mask = ((pos[:, None] - pos[None, :]) < width)[None, None]
    scale = head_dim**-0.5
    kernels = {
        "cudnn": lambda q, k, v: flash_attention("cudnn", q, k, v, segments, scale=scale, softcap=0.0, window=width),
        "xla": lambda q, k, v: xla_attention(q, k, v, mask, True, scale, 0.0),
    }
    outs, seconds = {}, {}
    for name, fn in kernels.items():
        step = jax.jit(lambda q, k, v, fn=fn: (lambda out, vjp: (out, *vjp(cotangent)))(*jax.vjp(fn, q, k, v)))
        outs[name] = [np.asarray(x, np.float32) for x in jax.block_until_ready(step(q, k, v))]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(step(q, k, v))
            times.append(time.perf_counter() - start)
        seconds[name] = min(times)
    errors = [np.abs(a - b).max() / np.abs(b).max() for a, b in zip(outs["cudnn"], outs["xla"])]
    verdict = "within" if max(errors) <= TOLERANCE else "OVER"
    diffs = ", ".join(f"{n} {e:.4f}" for n, e in zip(("out", "dq", "dk", "dv"), errors))
    shape = f"{batch}x{seq}, {heads}/{kv_heads} heads of {head_dim}" + (f", window {width}" if width else "")
    return (f"cuDNN attention, {case} ({shape})",
            f"max diff / max: {diffs} ({verdict} {TOLERANCE}); fwd+bwd {seconds['cudnn'] * 1e3:.2f} ms",
            f"XLA {seconds['xla'] * 1e3:.2f} ms", f"{seconds['xla'] / seconds['cudnn']:.2f}x faster")


def mfu(r: dict) -> str:
    return f"MFU {r['mfu']:.1%}" if r.get("mfu") is not None else "MFU: no spec peak (CPU)"


def anchor(r: dict) -> str:
    if r.get("anchor_mfu") is None:
        return ""
    return f"{r['anchor_mfu']:.1%} of the measured matmul ({r['anchor_tflops']:.0f} TFLOP/s)"


def one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:200].replace("|", "/")


if __name__ == "__main__":
    main()
