"""benchmarks/gpu_check.py on CPU: every part leaves its rows in the table, and a failing part leaves a FAILED row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_the_cpu_run_prints_a_row_for_every_part() -> None:
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    table = run.stdout.split("| check | result | anchor | ratio |\n|---|---|---|---|\n")[1]
    rows = {cells[1].strip(): cells[2:] for cells in (line.split("|") for line in table.splitlines())}
    assert rows["XLA flags"][0].strip() == "xla flags (cpu): none"
    for case in ("causal", "window", "documents"):
        assert rows[f"cuDNN attention, {case}"][0].strip() == "SKIPPED: needs an NVIDIA GPU"
    assert {f"train step, {family}" for family in gpu_check.FAMILIES} <= set(rows)
    assert rows["train step, tiny"][2].strip().endswith("x, ok")
    assert "tok/s" in rows["1B, xla attention, remat none"][0]
    for name in ("1B int8, xla attention, remat none", "1B fp8, xla attention, remat none",
                 "MoE dropless (ragged_dot), Mixtral-like"):
        assert rows[name][2].strip()[0].isdigit(), (name, rows[name])  # a ratio against its anchor
    assert [k for k in rows if k.startswith("goal:")] and "FAILED" not in table


def test_a_failing_part_becomes_one_failed_row() -> None:
    check = gpu_check.Check(cpu=True, budget=60)

    def broken() -> None:
        raise RuntimeError("out of memory\nwith a long trace")

    check.run("MoE", broken)
    assert check.rows == [("MoE", "FAILED: RuntimeError: out of memory", "", "")]
