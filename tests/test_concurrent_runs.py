"""Two `maxpipe run`s of one config on one root: each step's work is done once; a killed run's lease is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import small_corpus

STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return small_corpus(tmp_path_factory.mktemp("concurrent") / "corpus", limit_bytes=120_000)


def maxpipe_run(corpus: Path, root: Path, *extra: str) -> subprocess.Popen:
    args = ["tiny", f"data.input={corpus}/*.py", f"pipeline.root={root}", f"train.steps={STEPS}",
            "train.checkpoint_every=2", "eval.max_new_tokens=4", "eval.max_batches=2",
            "data.beam_args=[--direct_num_workers=1]", *extra]
    # A session of its own, so that a kill reaches the run's step processes too (as a lost machine would).
    return subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def store_dirs(root: Path, step: str) -> list[Path]:
    return [p for p in (root / "store" / step).iterdir() if p.is_dir()]


def test_two_runs_at_once_do_each_step_once(corpus, tmp_path):
    root = tmp_path / "runs"
    first = maxpipe_run(corpus, root)
    time.sleep(2)
    second = maxpipe_run(corpus, root)
    out_first, _ = first.communicate(timeout=600)
    out_second, _ = second.communicate(timeout=600)
    assert first.returncode == 0, out_first[-3000:]
    assert second.returncode == 0, out_second[-3000:]
    for step in ("prep", "train", "export", "eval"):
        assert len(store_dirs(root, step)) == 1
    (train,) = store_dirs(root, "train")
    rows = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one training, not two interleaved
    # Either run may reach a step first: per step, one publishes and the other reports a cache hit.
    both = out_first + out_second
    for step in ("prep", "train", "export", "eval"):
        assert both.count(f"[{step}] published version") == 1 and both.count(f"[{step}] cache hit") == 1
    waits = [line for line in both.splitlines() if "waiting for " in line]
    assert waits and ", held by " in waits[0] and " since " in waits[0]
    step = waits[0].split("waiting for ")[1].split()[0]
    waiter = out_first if waits[0] in out_first else out_second
    assert f"[{step}] cache hit" in waiter.split(waits[0])[1]  # then used what the other run made


def test_a_killed_run_leaves_a_lease_the_next_run_takes_over(corpus, tmp_path):
    root = tmp_path / "runs"
    doomed = maxpipe_run(corpus, root)
    seen = ""
    for line in doomed.stdout:  # kill it once training has written a checkpoint
        seen += line
        if "[train]" in seen and list(root.glob("store/train/*/checkpoints/2")):
            break
    else:
        pytest.fail(f"the run ended before its first checkpoint:\n{seen[-3000:]}")
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait()
    (train,) = store_dirs(root, "train")
    assert (train / ".lease").is_dir() and not (train / "manifest.json").exists()

    # The rerun logs more often: a run setting, so the same training continues rather than restarting.
    rerun = maxpipe_run(corpus, root, "train.log_every=1")
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out[-3000:]
    assert f"taking over train {train.name} from " in out and "which has exited" in out
    assert "resumed from step" in out
    assert store_dirs(root, "train") == [train] and (train / "manifest.json").is_file()
    assert not (train / ".lease").exists()
    steps = [json.loads(line)["step"] for line in (train / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
