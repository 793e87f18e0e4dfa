"""Time the default `maxpipe run` end to end; anchors: the train step's own time, the matmul peak, the first run.

    python benchmarks/pipeline_run.py [PRESET] [key=value ...]

Prints the wall time, each step's time, the share of the wall time spent training (the rest is
orchestration, prep, export and eval), the training MFU against this machine's measured matmul
peak and the final losses; then runs the same pipeline again on the same root, which must be
served from the artifact store, and prints its time against the first run's. Record the output in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
import tempfile
import time

from configs import load_config
from pipelines.local import run_local, summary


def main(argv: list[str]) -> None:
    preset = argv[0] if argv and "=" not in argv[0] else None
    overrides = argv[1:] if preset else argv
    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(preset, [f"pipeline.root={root}", *overrides])
        start = time.perf_counter()
        result = run_local(cfg)
        wall = time.perf_counter() - start
        print(summary(result))
        m = result["manifests"]
        steps = {name: m[name]["stats"]["seconds"] for name in ("dataset", "checkpoints", "model", "report")}
        train = m["checkpoints"]["stats"]
        print()
        print(f"wall time             {wall:7.1f} s")
        for name, seconds in steps.items():
            print(f"  {m[name]['step']:<8} step      {seconds:7.1f} s")
        print(f"train share of wall   {steps['checkpoints'] / wall:7.1%}")
        print(f"train tokens/s        {train['tokens_per_s']:9,.0f}   MFU {train['mfu']:.1%} of {train['peak_source']}")
        print(f"final train loss      {train['final_loss']:.4f}   val loss {m['report']['stats']['val_loss']:.4f}")
        start = time.perf_counter()
        rerun = run_local(cfg)
        cached = time.perf_counter() - start
        assert rerun["manifests"] == m, "the rerun did not reuse every step"
        print(f"fully cached rerun    {cached:7.1f} s   = {cached / wall:.1%} of the first run")


if __name__ == "__main__":
    main(sys.argv[1:])
