"""Operating a run end to end: a profile and the HLO of real steps, goodput with a slow data source, a stalled step's
warning and stack dump, and a hang timeout whose rerun resumes and reports the lost steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from jax.profiler import ProfileData

from configs import load_config
from tests.trainer.test_train_data import random_dataset, split_train
from trainer.train import loop as train_module
from trainer.train.loop import train
from trainer.train.watchdog import EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
CATEGORIES = ("startup", "restore", "compile", "productive", "data_wait", "checkpoint", "validation", "other")
# Tiny steps on CPU take ~10 ms; every batch here costs DELAY more, one stalls.
DELAY, STALL = 0.05, 2.5


def stalled_fetch(seconds: float) -> None:
    time.sleep(seconds)


def test_profile_hlo_goodput_and_a_stalled_step(tmp_path: Path, monkeypatch) -> None:
    data = random_dataset(tmp_path / "data", rows=64, seq_len=32, vocab=512)
    fetches = []
    fetch = train_module._global_batch

    def slow_fetch(*args):
        fetches.append(1)
        stalled_fetch(STALL if len(fetches) == 10 else DELAY)  # the batch of step 10
        return fetch(*args)

    monkeypatch.setattr(train_module, "_global_batch", slow_fetch)
    cfg = load_config("tiny", [
        "train.steps=14", "train.batch_size=8", "train.warmup_steps=2", "train.checkpoint_every=7",
        "train.eval_every=7", "train.log_every=100", "train.profile={start: 3, steps: 2}", "train.hlo_dump=true",
        "train.slow_step_factor=10", "train.hang_dump_seconds=1.0",
    ])
    lines: list[str] = []
    start = time.time()
    summary = train(cfg.model, *split_train(cfg.train), data, tmp_path / "run", log=lines.append)
    wall = time.time() - start
    run = tmp_path / "run"

    # The profile: one host's XSpace where TensorBoard's profile plugin lists runs, holding the train step's XLA ops.
    (trace,) = (run / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb")
    ops = {
        dict(event.stats).get("hlo_op")
        for plane in ProfileData.from_file(str(trace)).planes for line in plane.lines for event in line.events
        if dict(event.stats).get("hlo_module") == "jit_step"
    }
    assert any(op and ("fusion" in op or "dot" in op) for op in ops), sorted(filter(None, ops))[:20]

    # The HLO dump: the optimized module of the train step, and its memory report.
    assert "HloModule jit_step" in (run / "hlo" / "train_step.hlo.txt").read_text()
    assert json.loads((run / "hlo" / "memory.json").read_text())["peak_bytes_per_device"] > 0

    # Goodput: the parts add up to the account's wall time, which is the call's (it started inside the call,
    # and the call returns right after the account is closed: 0.5 s covers the summary and the test's clock).
    account = json.loads((run / "goodput.json").read_text())
    seconds = {c: summary[f"goodput_{c}_seconds"] for c in CATEGORIES}
    total = summary["goodput_total_seconds"]
    assert abs(sum(seconds.values()) - total) < 1e-6 and 0 < wall - total < 0.5
    assert seconds["data_wait"] >= 13 * DELAY + STALL  # the slow source shows as data wait
    assert seconds["compile"] > 0 and seconds["checkpoint"] > 0 and seconds["validation"] > 0
    assert summary["goodput"] == seconds["productive"] / total < 0.5
    assert account["attempts"] and any(line.startswith("goodput ") for line in lines)

    # The stalled step: one warning naming it, then every thread's stack, the main thread's inside the stall.
    warnings = [line for line in lines if "has taken" in line]
    assert len(warnings) == 1 and "median" in warnings[0], lines
    dump = "\n".join(lines[lines.index(next(line for line in lines if "no progress" in line)):])
    assert "stalled_fetch" in dump and "MainThread" in dump


HUNG_RUN = """
import json, sys, time
from configs import load_config
from tests.trainer.test_train_data import split_train
from trainer.train import loop as train_module
from trainer.train.goodput import process_start
fetch, fetches = train_module._global_batch, []
def hung_fetch(*args):
    fetches.append(1)
    if len(fetches) == 9:  # the batch of step 9
        time.sleep(600)
    return fetch(*args)
train_module._global_batch = hung_fetch
cfg = load_config("tiny", json.loads(sys.argv[3]))
train_module.train(cfg.model, *split_train(cfg.train), sys.argv[1], sys.argv[2], started=process_start())
"""


def test_hang_timeout_exits_and_the_rerun_resumes_reporting_lost_steps(tmp_path: Path) -> None:
    data = random_dataset(tmp_path / "data", rows=64, seq_len=32, vocab=512)
    run = tmp_path / "run"
    overrides = ["train.steps=10", "train.batch_size=8", "train.warmup_steps=2", "train.checkpoint_every=5",
                 "train.log_every=1", "train.eval_every=0", "train.hang_exit_seconds=4"]
    proc = subprocess.run(
        [sys.executable, "-c", HUNG_RUN, str(data), str(run), json.dumps(overrides)], cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )
    assert proc.returncode == EXIT_CODE, proc.stderr[-2000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hang_exit_seconds" in errors[0], proc.stdout[-2000:]

    cfg = load_config("tiny", overrides)
    summary = train(cfg.model, *split_train(cfg.train), data, run, log=lambda _: None)
    assert summary["resumed_from"] == 5
    # Steps 6 and 7 were logged by the hung attempt (step 8's row waits for step 9's dispatch): done twice.
    assert summary["goodput_lost_steps"] == 2 and summary["goodput_lost_seconds"] > 0
    assert summary["goodput_attempts"] == 2 and summary["goodput_restart_seconds"] >= 4
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 11))
