"""The lease on a step's output: one holder at a time, waiters get the finished output, dead holders are taken over.

Each case runs on a local directory and on fsspec's memory filesystem standing in for gs:// (the
same create-if-absent path gcsfs takes with ifGenerationMatch=0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import fsspec
import pytest

from configs import UserError
from contract import lease


@pytest.fixture(params=["local", "memory"])
def output(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "out")
    return f"memory://store-{uuid.uuid4().hex}/train/v1"


def finished(output: str):
    fs, root = fsspec.core.url_to_fs(output)
    return lambda: fs.cat_file(f"{root}/done").decode() if fs.exists(f"{root}/done") else None


def finish(output: str, text: str) -> None:
    fs, root = fsspec.core.url_to_fs(output)
    fs.pipe_file(f"{root}/done", text.encode())


def test_one_holder_the_other_waits_then_gets_the_result(output):
    logs: list[str] = []
    order: list[str] = []
    inside = threading.Event()

    def first() -> None:
        with lease.held(output, "train v1", finished(output), timeout=30, poll=0.05, log=logs.append) as (done, held):
            assert done is None and held is not None
            inside.set()
            time.sleep(0.5)
            order.append("first worked")
            finish(output, "result of first")

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(10)
    with lease.held(output, "train v1", finished(output), timeout=30, poll=0.05, log=logs.append) as (done, held):
        order.append("second entered")
        assert (done, held) == ("result of first", None)
    thread.join()
    assert order == ["first worked", "second entered"]
    waiting = [line for line in logs if line.startswith("waiting for train v1, held by ")]
    assert waiting and " since " in waiting[0]
    fs, root = fsspec.core.url_to_fs(output)
    assert not fs.exists(f"{root}/{lease.LEASE_DIR}")  # a finished output keeps no lease files


def test_a_silent_holder_on_another_machine_is_taken_over(output):
    fs, root = fsspec.core.url_to_fs(output)
    dead = {"holder": "ci@elsewhere:7", "host": "elsewhere", "pid": 7, "what": "train v1", "since": "then",
            "beat": 3, "released": False}
    fs.makedirs(f"{root}/{lease.LEASE_DIR}", exist_ok=True)
    fs.pipe_file(f"{root}/{lease.LEASE_DIR}/000001.json", json.dumps(dead).encode())
    logs: list[str] = []
    start = time.monotonic()
    with lease.held(output, "train v1", finished(output), timeout=0.5, poll=0.05, log=logs.append) as (done, held):
        assert done is None and held.epoch == 2
        finish(output, "mine")
    assert time.monotonic() - start >= 0.5  # it waited out the timeout on its own clock first
    assert any("taking over train v1 from ci@elsewhere:7, silent for" in line for line in logs)


def test_a_holder_that_lost_its_lease_cannot_publish(output):
    with lease.held(output, "train v1", finished(output), timeout=30, poll=0.05, log=lambda _: None) as (_, held):
        fs, root = fsspec.core.url_to_fs(output)
        taker = {"holder": "other@host:1", "host": "host", "pid": 1, "beat": 0, "released": False, "what": "train v1"}
        assert held.files.create(held.epoch + 1, taker)
        assert not held.files.create(held.epoch + 1, taker)  # each number is created once
        with pytest.raises(UserError, match="other@host:1 took over the output"):
            held.check()
    assert json.loads(fs.cat_file(f"{root}/{lease.LEASE_DIR}/000002.json"))["holder"] == "other@host:1"


def test_an_unfinished_holder_releases_the_lease(output):
    with pytest.raises(RuntimeError):
        with lease.held(output, "train v1", finished(output), timeout=30, log=lambda _: None):
            raise RuntimeError("the work failed")
    with lease.held(output, "train v1", finished(output), timeout=30, log=lambda _: None) as (done, held):
        assert done is None and held.epoch == 2  # no waiting for a timeout


def test_a_killed_holder_on_this_machine_is_taken_over_at_once(tmp_path):
    output = str(tmp_path / "out")
    code = ("import sys, time; from contract import lease\n"
            f"with lease.held({output!r}, 'train v1', lambda: None, timeout=600, log=print) as _:\n"
            "    print('holding', flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    logs: list[str] = []
    with lease.held(output, "train v1", finished(output), timeout=600, poll=0.05, log=logs.append) as (done, held):
        assert done is None and held.epoch == 2
    assert any(f":{proc.pid}, which has exited" in line for line in logs)


def test_heartbeats_keep_a_slow_holder_alive(output):
    taken = []
    with lease.held(output, "train v1", finished(output), timeout=0.4, poll=0.05, log=lambda _: None):
        # The holder is alive, so only its heartbeats stop the waiter from taking over after the timeout.
        def wait() -> None:
            with lease.held(output, "train v1", finished(output), timeout=0.4, poll=0.05, log=lambda _: None) as (d, h):
                taken.append((d, h is not None))

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(1.5)  # well past the timeout
        assert not taken
        finish(output, "done")
    thread.join(10)
    assert taken == [("done", False)]


def test_a_waiter_with_a_shorter_timeout_waits_for_the_holders_own_beats(output):
    """A holder started with a longer lease_timeout beats less often: a waiter allows it four beat intervals."""
    fs, root = fsspec.core.url_to_fs(output)
    slow = {"holder": "ci@elsewhere:7", "host": "elsewhere", "pid": 7, "what": "train v1", "since": "then",
            "beat": 0, "beat_every": 30.0, "released": False}
    fs.makedirs(f"{root}/{lease.LEASE_DIR}", exist_ok=True)
    fs.pipe_file(f"{root}/{lease.LEASE_DIR}/000001.json", json.dumps(slow).encode())
    got = []

    def wait() -> None:
        with lease.held(output, "train v1", finished(output), timeout=0.2, poll=0.05, log=lambda _: None) as (d, h):
            got.append(h.epoch)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(1.0)  # five of the waiter's timeouts, far fewer than four of the holder's beats
    assert not got
    fs.pipe_file(f"{root}/{lease.LEASE_DIR}/000001.json", json.dumps({**slow, "released": True}).encode())
    thread.join(10)
    assert got == [2]
