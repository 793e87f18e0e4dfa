"""The train loop's watchdog: one warning per slow step, every thread's stack on a stall, and an exit on a hang.

Limits are tenths of a second and the thread polls every 10 ms; tests wait on the log lines they expect (with a
timeout), and show that a line did not come by waiting for a later one the watchdog would have logged after it.
"""

import threading

from trainer.train.watchdog import EXIT_CODE, Watchdog

POLL = 0.01
TIMEOUT = 10.0  # only reached when a test fails


class Log:
    """A log callable that records lines and lets a test wait for one."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def __call__(self, line: str) -> None:
        with self.changed:
            self.lines.append(line)
            self.changed.notify_all()

    def wait_for(self, start: str, count: int = 1) -> str:
        """The `count`-th line starting with `start`, waiting for it to be logged."""
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.starting(start)) >= count, TIMEOUT), self.lines
            return self.starting(start)[count - 1]

    def starting(self, start: str) -> list[str]:
        """The lines starting with `start` (a dumped stack shows the source line waiting for it, so not `in`)."""
        with self.changed:
            return [line for line in self.lines if line.startswith(start)]


def watchdog(log: Log, poll: float = POLL, **limits: float) -> Watchdog:
    limits = {"slow_factor": 0.0, "dump_seconds": 0.0, "exit_seconds": 0.0, **limits}
    return Watchdog(log=log, host=" on host 1 (h)", poll_seconds=poll, **limits)


def test_slow_step_is_warned_once_and_reported_when_it_finishes() -> None:
    log = Log()
    with watchdog(log, slow_factor=5.0, dump_seconds=0.3) as dog:
        for step in (1, 2, 3):
            dog.step_done(step, 0.01)
        warning = log.wait_for("warning: step 4 has taken")
        log.wait_for("warning: no progress for")  # much later than a second warning would come
        dog.step_done(4, 0.5)
    assert "x the median 0.01 s of the last 3 steps on host 1 (h)" in warning
    assert len(log.starting("warning: step 4 has taken")) == 1
    assert log.starting("step 4 took") == ["step 4 took 0.5 s, 50.0x the median 0.01 s on host 1 (h)"]


def test_no_slow_step_warning_before_min_steps() -> None:
    log = Log()
    with watchdog(log, slow_factor=2.0, dump_seconds=0.2) as dog:
        dog.step_done(1, 0.01)
        dog.step_done(2, 0.01)
        assert "in step 3 on host 1 (h)" in log.wait_for("warning: no progress for")  # after 20 medians
        dog.step_done(3, 0.5)
    assert not log.starting("warning: step"), log.lines


def test_a_slow_step_the_thread_missed_is_warned_when_it_finishes() -> None:
    log = Log()
    with watchdog(log, poll=60.0, slow_factor=5.0) as dog:  # the thread never looks
        for step in (1, 2, 3):
            dog.step_done(step, 0.01)
        dog.step_done(4, 0.2)
        dog.step_done(5, 0.01)
    assert log.lines == ["warning: step 4 took 0.2 s, 20.0x the median 0.01 s on host 1 (h)"]


def test_no_warning_inside_other_but_the_stacks_are_dumped() -> None:
    log = Log()
    with watchdog(log, slow_factor=2.0, dump_seconds=0.2) as dog:
        for step in (1, 2, 3):
            dog.step_done(step, 0.01)
        with dog.other("validation"):
            header = log.wait_for("warning: no progress for")
        assert "in validation after step 3 on host 1 (h) (train.hang_dump_seconds)" in header
        assert not log.starting("warning: step")
        log.wait_for("warning: step 4 has taken")  # the clock restarted when validation ended
        dog.step_done(4, 0.01)


def stalled_in_the_main_thread(log: Log) -> None:
    log.wait_for('thread "MainThread"')


def test_the_dump_shows_where_the_main_thread_is_stuck_once_per_stall() -> None:
    log = Log()
    with watchdog(log, dump_seconds=0.05) as dog:
        stalled_in_the_main_thread(log)
        main = log.wait_for('thread "MainThread"')
        assert "no progress for" in log.lines[0] and "in step 1 on host 1 (h)" in log.lines[0]
        assert "in stalled_in_the_main_thread\n    log.wait_for(" in main and "in wait_for" in main, main
        assert not log.starting('thread "watchdog"')
        dog.step_done(1, 0.05)
        assert "in step 2 on host 1 (h)" in log.wait_for("warning: no progress for", 2)  # the next stall's dump
    assert len(log.starting("warning: no progress for")) == 2


def test_a_hang_timeout_logs_the_stacks_then_one_error_and_exits() -> None:
    log, exits, exited = Log(), [], threading.Event()

    def exit(status: int) -> None:
        exits.append((status, list(log.lines)))
        exited.set()

    with Watchdog(0.0, 0.0, 0.1, log, host=" on host 1 (h)", exit=exit, poll_seconds=POLL, start_step=56):
        assert exited.wait(TIMEOUT)
    [(status, lines)] = exits  # the thread stops after telling the process to exit
    assert status == EXIT_CODE and lines == log.lines
    assert "in step 57 on host 1 (h) (train.hang_exit_seconds)" in lines[0]
    assert any('thread "MainThread"' in line for line in lines)
    [error] = log.starting("error:")
    assert error == lines[-1] and error.startswith("error: no progress for")
    assert error.endswith(f"in step 57 on host 1 (h) (train.hang_exit_seconds); exiting with status {EXIT_CODE} "
                          "so the orchestrator restarts the run, which resumes from its last checkpoint")


def test_an_error_in_the_thread_is_logged() -> None:
    log = Log()

    def exit(status: int) -> None:
        raise RuntimeError("cannot exit")

    with Watchdog(0.0, 0.0, 0.05, log, exit=exit, poll_seconds=POLL) as dog:
        failure = log.wait_for("error: the watchdog failed")
        dog.thread.join(TIMEOUT)
        assert not dog.thread.is_alive()
    assert "RuntimeError: cannot exit" in failure
    assert len(log.starting("error: the watchdog failed")) == 1


def test_everything_off_starts_no_thread() -> None:
    log, before = Log(), threading.active_count()
    with watchdog(log) as dog:
        assert threading.active_count() == before and dog.thread is None
        for step in (1, 2, 3, 4):
            dog.step_done(step, 0.01 if step < 4 else 10.0)
        with dog.other("checkpoint"):
            pass
    assert log.lines == []
