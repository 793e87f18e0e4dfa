"""What operating a run costs per step: train() with hang detection and goodput accounting on (and the profiler
off), and with a profile of a few steps, against train() with every watch off, in the same run.

    python benchmarks/operate_overhead.py [--steps N] [--profile-steps K]

Model: the demo preset's (5.2 M parameters, seq 256, batch 16) on a random-token dataset written first.
Trainings of N steps each on the same data: `off` (slow_step_factor and hang_dump_seconds 0: no watchdog
thread; the anchor, run first and last), `on` (the defaults: the watchdog thread polling, goodput accounting,
profile off) and `profiled` (the defaults plus train.profile of K steps from step N/2). Each figure is the
median step time from the run's metrics.jsonl, steps 3+ (the first step after compile left out; for `profiled`
its profiled steps too, whose own median is set against its other steps); ratios are against the mean of the
two `off` runs. Record the output in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from configs import TrainConfig, TrainSettings, load_config
from contract.records import DTYPE
from trainer.train.loop import train


def write_dataset(directory: Path, rows: int, seq_len: int, vocab: int) -> Path:
    """A train split of random tokens, concat-packed as prep writes it (no manifest: concat records)."""
    directory.mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, vocab, (rows, seq_len))
    writer = ArrayRecordWriter(str(directory / "train-00000-of-00001.array_record"), "group_size:1")
    for row in tokens:
        writer.write(row.astype(DTYPE).tobytes())
    writer.close()
    return directory


def step_times(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_time"] for r in rows if r["step"] >= 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    common = [f"train.steps={args.steps}", "train.warmup_steps=2", "train.eval_every=0",
              f"train.checkpoint_every={args.steps}", "train.log_every=1000"]
    demo = load_config("demo", common)
    data = write_dataset(root / "data", 512, demo.data.seq_len, demo.model.vocab_size)
    first = args.steps // 2
    variants = [
        ("off", ["train.slow_step_factor=0", "train.hang_dump_seconds=0"]),
        ("on", []),
        ("profiled", [f"train.profile={{start: {first}, steps: {args.profile_steps}}}"]),
        ("off", ["train.slow_step_factor=0", "train.hang_dump_seconds=0"]),
    ]
    medians: dict[str, list[float]] = {}
    for i, (name, overrides) in enumerate(variants):
        cfg = load_config("demo", common + overrides)
        settings = TrainSettings(**cfg.train.model_dump(include=set(TrainSettings.model_fields)))
        versioned = TrainConfig(**cfg.train.model_dump())
        summary = train(cfg.model, versioned, settings, data, root / str(i), log=lambda _: None)
        times = step_times(root / str(i))
        profiled = range(first, first + args.profile_steps) if name == "profiled" else range(0)
        median = statistics.median(t for s, t in times.items() if s not in profiled)
        medians.setdefault(name, []).append(median)
        line = f"{name:<9} median step {median:.4f} s  goodput {summary['goodput']:.1%}"
        if profiled:
            inside = statistics.median(times[s] for s in profiled)
            line += f"  profiled steps {inside:.4f} s ({inside / median:.3f}x its other steps)"
        print(line, flush=True)
    anchor = statistics.mean(medians["off"])
    for name in ("on", "profiled"):
        print(f"{name} / off (mean of the runs before and after): {medians[name][0] / anchor:.3f}", flush=True)

if __name__ == "__main__":
    sys.exit(main())
