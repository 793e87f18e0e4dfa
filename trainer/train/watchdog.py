"""Straggler and hang detection for the train loop: a thread that warns about a step far slower than the recent
median, dumps every thread's Python stack when nothing progresses for too long, and can end the process then."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

EXIT_CODE = 3  # the exit status on a hang timeout (1 is a user error, 2 a usage error)


class Watchdog:
    """Watches the train loop from a daemon thread polling every `poll_seconds`; every limit 0 is off.

    `host` ends each line (e.g. " on host 3 (name)"); `start_step` is the last step finished before this run.
    """

    def __init__(
        self, slow_factor: float, dump_seconds: float, exit_seconds: float, log: Callable[[str], None],
        host: str = "", exit: Callable[[int], None] = os._exit, window: int = 20, min_steps: int = 3,
        poll_seconds: float = 1.0, start_step: int = 0,
    ):
        self.slow_factor, self.dump_seconds, self.exit_seconds = slow_factor, dump_seconds, exit_seconds
        self.log, self.host, self.exit, self.min_steps, self.poll = log, host, exit, min_steps, poll_seconds
        self.times: deque[float] = deque(maxlen=window)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.last_step, self.phase, self.warned, self.dumped = start_step, None, None, False
        self.since = time.monotonic()

    def __enter__(self) -> Watchdog:
        self._progress()
        if self.slow_factor > 0 or self.dump_seconds > 0 or self.exit_seconds > 0:
            self.thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def step_done(self, step: int, seconds: float) -> None:
        """Record that `step` finished in `seconds` (logging it if it was slow) and reset the no-progress clock."""
        with self.lock:
            median = self._median()
            warned = self.warned == step
            # Stragglers count too: a few barely move a median, and a lasting slowdown becomes the new normal.
            self.times.append(seconds)
            self.last_step, self.warned = step, None
            self._progress()
        if median and (warned or seconds > self.slow_factor * median):
            ratio = f"{seconds / median:.1f}x the median {median:.2f} s"
            self.log(("" if warned else "warning: ") + f"step {step} took {seconds:.1f} s, {ratio}{self.host}")

    @contextmanager
    def other(self, what: str) -> Iterator[None]:
        """Work between steps (e.g. "validation"): no slow-step warning inside; leaving it resets the clock."""
        with self.lock:
            outer, self.phase = self.phase, what
        try:
            yield
        finally:
            with self.lock:
                self.phase = outer
                self._progress()

    def _progress(self) -> None:
        self.since, self.dumped = time.monotonic(), False

    def _median(self) -> float | None:
        if self.slow_factor <= 0 or len(self.times) < self.min_steps:
            return None
        return statistics.median(self.times)

    def _run(self) -> None:
        try:
            while not self.stop.wait(self.poll):
                if self._poll():
                    return
        except Exception:  # the thread has no caller to raise to
            self.log(f"error: the watchdog failed{self.host} and no longer checks for slow steps or hangs: "
                     + traceback.format_exc().rstrip())

    def _poll(self) -> bool:
        """One check; True once the process has been told to exit."""
        with self.lock:
            elapsed, median, phase, step = time.monotonic() - self.since, self._median(), self.phase, self.last_step + 1
            warn = bool(median) and phase is None and self.warned != step and elapsed > self.slow_factor * median
            leave = self.exit_seconds > 0 and elapsed > self.exit_seconds
            dump = not self.dumped and (leave or self.dump_seconds > 0 and elapsed > self.dump_seconds)
            self.warned = step if warn else self.warned
            self.dumped = self.dumped or dump
            where = f"in {phase} after step {step - 1}" if phase else f"in step {step}"
        if warn:
            self.log(f"warning: step {step} has taken {elapsed:.1f} s so far, {elapsed / median:.1f}x the median "
                     f"{median:.2f} s of the last {len(self.times)} steps{self.host}")
        if dump:  # a hang timeout always leaves the stacks, whatever hang_dump_seconds says
            key = "exit" if leave else "dump"
            self._dump(f"no progress for {elapsed:.1f} s {where}{self.host} (train.hang_{key}_seconds)")
        if leave:
            try:
                self.log(f"error: no progress for {elapsed:.1f} s {where}{self.host} (train.hang_exit_seconds); "
                         f"exiting with status {EXIT_CODE} so the orchestrator restarts the run, which resumes from "
                         "its last checkpoint")
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
            finally:
                self.exit(EXIT_CODE)
        return leave

    def _dump(self, why: str) -> None:
        """Log `why` and then the Python stack of every thread but this one."""
        self.log(f"warning: {why}; the Python stack of every thread follows")
        frames = sys._current_frames()
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            if frame is None or thread.ident == threading.get_ident():
                continue
            stack = "".join(traceback.format_stack(frame)).rstrip()
            self.log(f'thread "{thread.name}" (id {thread.ident}{", daemon" if thread.daemon else ""}){self.host}:\n'
                     + stack)
