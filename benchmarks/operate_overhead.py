"""What operating a run costs per step: train() with hang detection and goodput accounting on (and the profiler
off), and with a profile of a few steps, against train() with every watch off, in the same run.

    python benchmarks/operate_overhead.py [--steps N] [--profile-steps K]

Model: the demo preset's (5.2 M parameters, seq 256, batch 16) on a random-token dataset written first.
Three trainings of N steps each, same data, same compiled step: `off` (slow_step_factor, hang_dump_seconds
0: no watchdog thread; the anchor), `on` (the defaults: watchdog thread polling, goodput accounting, profile
off) and `profiled` (the defaults plus train.profile of K steps from step N/2). Each figure is the median
step time from the run's metrics.jsonl, steps 3+ (the first step after compile is left out); `profiled`
also gives its profiled steps' median against its own other steps. Record the output in benchmarks/RESULTS.md.
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
from trainer.train import train


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
    variants = {
        "off": ["train.slow_step_factor=0", "train.hang_dump_seconds=0"],
        "on": [],
        "profiled": [f"train.profile={{start: {first}, steps: {args.profile_steps}}}"],
    }
    medians = {}
    for name, overrides in variants.items():
        cfg = load_config("demo", common + overrides)
        settings = TrainSettings(**cfg.train.model_dump(include=set(TrainSettings.model_fields)))
        versioned = TrainConfig(**cfg.train.model_dump())
        summary = train(cfg.model, versioned, settings, data, root / name, log=lambda _: None)
        times = step_times(root / name)
        profiled = range(first, first + args.profile_steps) if name == "profiled" else range(0)
        medians[name] = statistics.median(t for s, t in times.items() if s not in profiled)
        line = (f"{name:<9} median step {medians[name]:.4f} s ({medians[name] / medians['off']:.3f}x off)  "
                f"goodput {summary['goodput']:.1%}")
        if profiled:
            inside = statistics.median(times[s] for s in profiled)
            line += f"  profiled steps {inside:.4f} s ({inside / medians[name]:.3f}x its other steps)"
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
