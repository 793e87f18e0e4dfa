"""Goodput: where a training run's wall time went, across the attempts that restarts split it into.

The definitions are those of Google's ml-goodput-measurement (goodput = productive step time / total time),
measured here from this process's clock and kept in the run directory, with no Cloud Logging. An attempt (one
process running train()) accounts its time from `started` (the process's start, so imports count) to its last
save; every second goes to one category: the innermost phase open at the time, else start-up until training
begins and productive after. Its categories, and the badput types of ml-goodput-measurement they are:

    startup     imports, devices, model and optimizer init      TPU_INITIALIZATION, TRAINING_PREP
    restore     reading a checkpoint                            UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME
    compile     compiling the train step                        PROGRAM_STARTUP
    data_wait   waiting for the next batch                      DATA_LOADING_SYNC
    checkpoint  the blocking part of checkpoint saves           UNPRODUCTIVE_CHECKPOINT_SAVE_TIME
    validation  validation loss during training                 CUSTOM_BADPUT_EVENTS
    other       time a caller sets apart as none of these       OTHER
    productive  training steps                                  (goodput)
    lost        steps a later attempt redid: the step_time of   WASTED_PROGRESS_FROM_DISRUPTION
                their metrics rows, moved out of this attempt's productive time (at most all of it)

Between attempts, restart = the next attempt's start - this one's last save: its unrecorded tail and the
downtime until the next process started (INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION). The total is the sum of
all of these, which is the span from the first attempt's start to the last save (unless attempts overlapped).

goodput.json: {"attempts": [{started, updated (time.time() of the last save), resumed_from (checkpoint step;
null if not resumed), last_step (newest step whose metrics row was written), lost_steps, seconds: {category:
seconds}}], "totals": what Goodput.finish returns}.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

GOODPUT_FILE = "goodput.json"
PHASES = ("restore", "compile", "data_wait", "checkpoint", "validation", "other")
CATEGORIES = ("startup", *PHASES, "productive", "lost")
LABELS = {
    "productive": "productive", "startup": "start-up", "restore": "restore", "compile": "compile",
    "data_wait": "data wait", "checkpoint": "checkpoints", "validation": "validation", "other": "other",
    "lost": "lost to restarts", "restart": "between attempts",
}  # the parts of the total, in the order reports list them
Attempt = dict[str, Any]


def process_start() -> float | None:
    """time.time() at which this process started (Linux: /proc/self/stat starttime against /proc/uptime), None
    where unknown."""
    try:
        # The process name (field 2) may hold spaces and parentheses: count the fields after its closing one.
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Goodput:
    """One attempt's account, added to those of the earlier attempts recorded at `path` (a resumed run).

    `path` None keeps the account without reading or writing a file (processes other than 0). `started`: the
    time.time() at which the attempt began (None: now). An unreadable file is reported with `log` and replaced.
    """

    def __init__(
        self, path: str | Path | None, started: float | None = None, clock: Callable[[], float] = time.time,
        log: Callable[[str], None] = print,
    ):
        self.path, self.clock = None if path is None else Path(path), clock
        self.earlier: list[Attempt] = []
        if self.path is not None and self.path.exists():
            try:
                self.earlier = _read_attempts(self.path)
            except (OSError, ValueError) as err:
                log(f"warning: {self.path}: {err}; the account starts again with this attempt")
        now = clock()
        self.since = now if started is None else min(started, now)
        self.attempt: Attempt = {"started": self.since, "updated": self.since, "resumed_from": None, "last_step": 0,
                                 "lost_steps": 0, "seconds": dict.fromkeys(CATEGORIES, 0.0)}
        self.base, self.open = "startup", []  # open: the phases entered and not yet left, innermost last

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time inside goes to `name` (one of PHASES), unless a phase opened inside it takes it."""
        if name not in PHASES:
            raise ValueError(f"unknown goodput phase {name!r}: one of {', '.join(PHASES)}")
        self._accrue()
        self.open.append(name)
        try:
            yield
        finally:
            self._accrue()
            self.open.pop()

    def begin_training(self) -> None:
        """From now on, time outside any phase is productive (before: start-up)."""
        self._accrue()
        self.base = "productive"

    def resumed(self, step: int, metrics_path: str | Path) -> None:
        """This attempt resumes from checkpoint `step` (0: from scratch); call before metrics.jsonl is cut back.

        The previous attempt's rows after `step`, up to its last save's step, are steps redone: lost. Saves.
        """
        self.attempt["resumed_from"] = step
        if self.earlier:
            previous = self.earlier[-1]
            rows = [r for r in _rows(Path(metrics_path)) if step < r["step"] <= previous["last_step"]]
            seconds = previous["seconds"]
            seconds["productive"] += seconds["lost"]  # a second call recounts rather than adds
            seconds["lost"] = min(sum(_seconds(r.get("step_time")) for r in rows), seconds["productive"])
            seconds["productive"] -= seconds["lost"]
            previous["lost_steps"] = len(rows)
        self.save(step)

    def save(self, last_step: int) -> None:
        """Account the time up to now and write the whole run's account (atomically); `last_step`: the newest step
        whose metrics row is written."""
        self._accrue()
        self.attempt["last_step"] = last_step
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"attempts": self.attempts, "totals": self.totals()}, indent=1) + "\n")
        os.replace(tmp, self.path)

    def finish(self, last_step: int) -> dict[str, float]:
        """The final save; returns the run's totals (see `totals`)."""
        self.save(last_step)
        return self.totals()

    @property
    def attempts(self) -> list[Attempt]:
        return [*self.earlier, self.attempt]

    def totals(self) -> dict[str, float]:
        """The whole run's totals as of the last save: goodput, goodput_{part}_seconds for each part of
        goodput_total_seconds, goodput_lost_steps, goodput_attempts."""
        return totals_of(self.attempts)

    def line(self) -> str:
        """The totals as one readable line."""
        return line_of(self.totals())

    def _accrue(self) -> None:
        now = self.clock()
        self.attempt["seconds"][self.open[-1] if self.open else self.base] += now - self.since
        self.since = self.attempt["updated"] = now


def totals_of(attempts: list[Attempt]) -> dict[str, float]:
    """The totals of a run made of `attempts`, in order (see Goodput.totals)."""
    seconds = {c: sum(a["seconds"][c] for a in attempts) for c in CATEGORIES}
    seconds["restart"] = sum((max(0.0, b["started"] - a["updated"]) for a, b in zip(attempts, attempts[1:])), 0.0)
    total = sum(seconds.values())
    return {
        "goodput": seconds["productive"] / total if total > 0 else 0.0,
        "goodput_total_seconds": total,
        **{f"goodput_{part}_seconds": value for part, value in seconds.items()},
        "goodput_lost_steps": sum(a["lost_steps"] for a in attempts),
        "goodput_attempts": len(attempts),
    }


def read_totals(path: str | Path) -> dict[str, float] | None:
    """The totals of the run whose goodput.json is at `path`; None where it is absent or unreadable."""
    try:
        attempts = _read_attempts(Path(path))
    except (OSError, ValueError):
        return None
    return totals_of(attempts) if attempts else None


def parts(totals: dict[str, float]) -> list[tuple[str, float]]:
    """(label, seconds) of each part of the total, productive first."""
    return [(label, totals[f"goodput_{part}_seconds"]) for part, label in LABELS.items()]


def line_of(totals: dict[str, float]) -> str:
    """Totals (Goodput.totals, or a train manifest's stats) as one line: goodput, then where the rest went (parts
    under 0.05 s left out), then the restarts if there were any."""
    (_, productive), *badput = parts(totals)
    rest = ", ".join(f"{label} {seconds:.1f}" for label, seconds in badput if seconds >= 0.05)
    line = (f"goodput {totals['goodput']:.1%} of {totals['goodput_total_seconds']:.1f} s: productive {productive:.1f} s"
            + (f"; {rest}" if rest else ""))
    if totals["goodput_attempts"] > 1:
        line += f"; {totals['goodput_attempts']} attempts, {totals['goodput_lost_steps']} steps redone"
    return line


def _read_attempts(path: Path) -> list[Attempt]:
    """The attempts a goodput.json records; ValueError where it is not one."""
    try:
        return [_attempt(raw) for raw in json.loads(path.read_text())["attempts"]]
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:
        raise ValueError(f"not a goodput account ({type(err).__name__}: {err})") from None


def _attempt(raw: dict[str, Any]) -> Attempt:
    resumed = raw.get("resumed_from")
    return {
        "started": float(raw["started"]), "updated": float(raw["updated"]),
        "resumed_from": None if resumed is None else int(resumed), "last_step": int(raw["last_step"]),
        "lost_steps": int(raw.get("lost_steps", 0)),
        "seconds": {c: float(raw["seconds"].get(c, 0.0)) for c in CATEGORIES},
    }


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a metrics.jsonl that name their step; a half-written or foreign line is skipped."""
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            yield row


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0
