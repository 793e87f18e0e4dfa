"""Goodput accounting on a fake clock: phases, a resumed run's lost steps and restart gap, unreadable files, the
report's section, the process start."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from trainer.train.goodput import CATEGORIES, GOODPUT_FILE, Goodput, line_of, process_start, read_totals
from trainer.eval.report import write_report

PARTS = (*CATEGORIES, "restart")


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def seconds_of(totals: dict[str, float]) -> dict[str, float]:
    return {part: totals[f"goodput_{part}_seconds"] for part in PARTS}


def test_phases_add_up_to_the_wall_time(tmp_path: Path) -> None:
    clock = Clock(100.0)
    account = Goodput(tmp_path / GOODPUT_FILE, started=90.0, clock=clock)  # the process started 10 s ago
    clock.tick(5)
    with account.phase("restore"):
        clock.tick(2)
    with account.phase("compile"):
        clock.tick(3)
        with account.phase("data_wait"):  # the innermost phase wins
            clock.tick(1)
        clock.tick(1)
    account.begin_training()
    clock.tick(10)
    for name, seconds in (("checkpoint", 2), ("validation", 1), ("other", 0.5)):
        with account.phase(name):
            clock.tick(seconds)
    with pytest.raises(RuntimeError), account.phase("data_wait"):  # a phase ends with its block, however it ends
        clock.tick(0.25)
        raise RuntimeError
    clock.tick(4)
    with pytest.raises(ValueError, match="unknown goodput phase 'eval'"), account.phase("eval"):
        pass
    totals = account.finish(20)

    assert seconds_of(totals) == {"startup": 15, "restore": 2, "compile": 4, "data_wait": 1.25, "checkpoint": 2,
                                  "validation": 1, "other": 0.5, "productive": 14, "lost": 0, "restart": 0}
    assert totals["goodput_total_seconds"] == sum(seconds_of(totals).values()) == clock.now - 90 == 39.75
    assert totals["goodput"] == 14 / 39.75 and totals["goodput_attempts"] == 1 and totals["goodput_lost_steps"] == 0
    written = json.loads((tmp_path / GOODPUT_FILE).read_text())
    assert written["totals"] == totals and read_totals(tmp_path / GOODPUT_FILE) == totals
    (attempt,) = written["attempts"]
    assert attempt["started"] == 90 and attempt["updated"] == clock.now and attempt["last_step"] == 20
    assert attempt["resumed_from"] is None and sum(attempt["seconds"].values()) == 39.75
    assert account.line() == line_of(totals) == (
        "goodput 35.2% of 39.8 s: productive 14.0 s; start-up 15.0, restore 2.0, compile 4.0, data wait 1.2, "
        "checkpoints 2.0, validation 1.0, other 0.5"
    )


def test_a_resumed_run_counts_the_steps_it_redoes_and_the_gap(tmp_path: Path) -> None:
    path, metrics = tmp_path / GOODPUT_FILE, tmp_path / "metrics.jsonl"
    clock = Clock(1000.0)
    first = Goodput(path, clock=clock)
    clock.tick(2)
    first.begin_training()
    clock.tick(8)
    first.save(7)  # then killed: 3 s the account never saw, and rows 8 and 9 past its last save
    clock.tick(3)
    metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0, "step_time": s / 2}) + "\n" for s in range(1, 10)))

    clock.tick(20)
    second = Goodput(path, started=1030.0, clock=clock)  # started 3 s before it could account anything
    second.resumed(5, metrics)
    assert len(json.loads(path.read_text())["attempts"]) == 2  # saved at once: a kill now still shows the attempt
    second.resumed(5, metrics)  # a second call recounts, it does not add
    with second.phase("restore"):
        clock.tick(1)
    second.begin_training()
    clock.tick(4)
    totals = second.finish(9)

    lost = 6 / 2 + 7 / 2  # steps 6 and 7: done twice; 8 and 9 fall in the gap
    assert totals["goodput_lost_steps"] == 2 and totals["goodput_lost_seconds"] == lost
    assert seconds_of(totals) == {"startup": 2 + 3, "restore": 1, "compile": 0, "data_wait": 0, "checkpoint": 0,
                                  "validation": 0, "other": 0, "productive": 8 - lost + 4, "lost": lost,
                                  "restart": 1030 - 1010}
    assert totals["goodput_total_seconds"] == sum(seconds_of(totals).values()) == clock.now - 1000
    assert totals["goodput"] == (8 - lost + 4) / (clock.now - 1000) and totals["goodput_attempts"] == 2
    attempts = json.loads(path.read_text())["attempts"]
    assert [a["resumed_from"] for a in attempts] == [None, 5] and [a["last_step"] for a in attempts] == [7, 9]
    assert attempts[0]["seconds"]["lost"] == lost and attempts[0]["lost_steps"] == 2
    assert [sum(a["seconds"].values()) for a in attempts] == [10, clock.now - 1030]
    assert line_of(totals).endswith("lost to restarts 6.5, between attempts 20.0; 2 attempts, 2 steps redone")


def test_an_unreadable_account_is_replaced_and_no_path_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / GOODPUT_FILE
    for garbage in (b'{"attempts": [{"started": 1', b'{"attempts": [{"started": 1}]}', b"[]", b"\xff"):
        path.write_bytes(garbage)
        warnings: list[str] = []
        account = Goodput(path, clock=Clock(50.0), log=warnings.append)
        assert read_totals(path) is None
        assert len(warnings) == 1 and warnings[0].startswith(f"warning: {path}: ") and "starts again" in warnings[0]
        account.save(0)
        assert read_totals(path)["goodput_attempts"] == 1  # replaced by this attempt's account
    assert read_totals(tmp_path / "absent.json") is None

    nowhere = tmp_path / "nowhere"
    nowhere.mkdir()
    clock = Clock(0.0)
    account = Goodput(None, clock=clock)  # a process other than 0: accounts, reads and writes nothing
    account.begin_training()
    clock.tick(3)
    account.resumed(2, nowhere / "metrics.jsonl")
    assert account.finish(3)["goodput_productive_seconds"] == 3 and not list(nowhere.iterdir())


@pytest.mark.parametrize("resumed_from, steps, seconds", [
    (1, 2, 1.5),  # rows 2 and 3 (no usable step_time); row 4 is torn
    (0, 3, 2.0),  # rows 1 to 3: 10.5 s, more than the attempt's 2 s of productive time
])
def test_lost_steps_skip_torn_rows_and_take_at_most_the_productive_time(
    tmp_path: Path, resumed_from: int, steps: int, seconds: float,
) -> None:
    path, metrics = tmp_path / GOODPUT_FILE, tmp_path / "metrics.jsonl"
    clock = Clock(0.0)
    first = Goodput(path, clock=clock)
    first.begin_training()
    clock.tick(2)
    first.save(4)
    metrics.write_text('{"step": 1, "step_time": 9}\n{"step": 2, "step_time": 1.5}\n[2]\n{"loss": 3}\n'
                       '{"step": 3, "step_time": "x"}\n{"step": 4, "step_ti')
    Goodput(path, clock=clock).resumed(resumed_from, metrics)
    totals = read_totals(path)
    assert totals["goodput_lost_steps"] == steps and totals["goodput_lost_seconds"] == seconds
    assert totals["goodput_productive_seconds"] == 2 - seconds and totals["goodput_total_seconds"] == 2


def test_report_has_a_goodput_section_when_the_run_has_an_account(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    results = {"val_loss": 4.5, "val_perplexity": 90.0, "val_tokens": 1000, "prompt": "a", "sample": "b"}
    write_report(tmp_path / "without", results, run / "metrics.jsonl")
    assert "Goodput" not in (tmp_path / "without" / "report.html").read_text()
    assert "Goodput" not in (tmp_path / "without" / "report.md").read_text()

    clock = Clock(0.0)
    account = Goodput(run / GOODPUT_FILE, clock=clock)
    clock.tick(1)
    account.begin_training()
    clock.tick(3)
    account.finish(1)
    write_report(tmp_path / "with", results, run / "metrics.jsonl")
    page = (tmp_path / "with" / "report.html").read_text()
    assert "<h2>Goodput</h2>" in page
    assert "<p>75.0% of 4.0 s of training was productive (goodput), over 1 attempt(s); 0 step(s) were" in page
    assert "<tr><td>productive</td><td>3.0</td><td>75.0%</td></tr>" in page
    assert "<tr><td>start-up</td><td>1.0</td><td>25.0%</td></tr>" in page
    assert "| data wait | 0.0 | 0.0% |" in (tmp_path / "with" / "report.md").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_process_start_is_this_process_start() -> None:
    started = process_start()
    assert started is not None and time.time() - 86400 < started <= time.time()
