"""A lease on a step's output directory, so that two runs never produce one output at once.

The lease is a numbered file per holder, `{output}/.lease/000001.json`, `000002.json`, ... Taking the
lease creates the next number with the store's own create-if-absent (`O_EXCL` on local disks, a
generation-conditioned create, `ifGenerationMatch=0`, on `gs://` through gcsfs), so of two runs
exactly one gets each number. The holder rewrites its file as a heartbeat; a run that finds a
higher number than its own has lost the lease. A waiter takes the lease over when the holder
released it, when the holder's heartbeat has not changed for `timeout` seconds of the waiter's own
clock (no clocks are compared across machines; at least four of the holder's beat intervals), or at
once when the holder was a process on this machine that no longer exists. Only the newest file counts; the older ones stay as the record.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from configs import UserError

LEASE_DIR = ".lease"

Log = Callable[[str], None]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class _Record:
    epoch: int
    body: dict[str, Any]  # {holder, host, pid, what, since, beat, beat_every, released}; {} while being written


class _Files:
    """The lease files of one output directory, on any fsspec filesystem."""

    def __init__(self, output: str):
        self.fs, root = fsspec.core.url_to_fs(output)
        self.dir = f"{root.rstrip('/')}/{LEASE_DIR}"
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, epoch: int) -> str:
        return f"{self.dir}/{epoch:06d}.json"

    def newest(self) -> _Record | None:
        """The highest-numbered lease file and what it holds."""
        self.fs.invalidate_cache(self.dir)
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.dir, detail=False)]
        except FileNotFoundError:
            return None
        epochs = [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]
        if not epochs:
            return None
        epoch = max(epochs)
        try:
            return _Record(epoch, json.loads(self.fs.cat_file(self.path(epoch))))
        except (FileNotFoundError, ValueError):  # being created or rewritten right now: a live holder
            return _Record(epoch, {})

    def create(self, epoch: int, body: dict[str, Any]) -> bool:
        """Write lease file `epoch` if no one has: True when this call created it."""
        data = json.dumps(body).encode()
        try:
            if self.local:
                os.makedirs(self.dir, exist_ok=True)
                with open(self.path(epoch), "xb") as f:  # O_EXCL: atomic on a local disk
                    f.write(data)
            else:
                self.fs.pipe_file(self.path(epoch), data, mode="create")  # gcsfs: ifGenerationMatch=0
        except FileExistsError:
            return False
        return True

    def rewrite(self, epoch: int, body: dict[str, Any]) -> None:
        """Replace the holder's own lease file whole."""
        data = json.dumps(body).encode()
        if self.local:
            tmp = f"{self.path(epoch)}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(epoch))
        else:
            self.fs.pipe_file(self.path(epoch), data)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.dir, recursive=True)


def _holder_gone(body: dict[str, Any]) -> bool:
    """Whether the holder was a process on this machine that has exited."""
    if body.get("host") != socket.gethostname() or not body.get("pid"):
        return False
    try:
        os.kill(body["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class Lease:
    """A held lease: heartbeats in a background thread until released."""

    def __init__(self, files: _Files, epoch: int, body: dict[str, Any], interval: float, log: Log):
        self.files, self.epoch, self.body, self.log = files, epoch, body, log
        self.lost_to: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(interval,), daemon=True, name="lease-heartbeat")
        self._thread.start()

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            newest = self.files.newest()
            if newest is not None and newest.epoch > self.epoch:
                self.lost_to = newest.body.get("holder", "another run")
                self.log(f"warning: lost the lease on {self.body['what']} to {self.lost_to}")
                return
            self.body["beat"] += 1
            with contextlib.suppress(OSError):  # a missed beat is retried; `timeout` allows several
                self.files.rewrite(self.epoch, self.body)

    def check(self) -> None:
        """Raise one line if another run has taken this lease over (then it owns the output)."""
        newest = self.files.newest()
        if self.lost_to or (newest is not None and newest.epoch > self.epoch):
            holder = self.lost_to or newest.body.get("holder", "another run")
            raise UserError(f"{self.body['what']}: {holder} took over the output while this run was silent "
                            "for longer than pipeline.lease_timeout; nothing was published by this run")

    def release(self, finished: bool) -> None:
        """Stop heartbeating; a finished output needs no lease files, an unfinished one is marked released."""
        self._stop.set()
        self._thread.join()
        if self.lost_to:
            return
        if finished:
            self.files.remove()
        else:
            self.body["released"] = True
            with contextlib.suppress(OSError):
                self.files.rewrite(self.epoch, self.body)


@contextlib.contextmanager
def held(
    output: str, what: str, done: Callable[[], Any], *, timeout: float = 120.0, poll: float = 1.0,
    log: Log = print,
) -> Iterator[tuple[Any, Lease | None]]:
    """Hold the lease on `output` for the block; yields `(done(), None)` instead when the output is complete.

    `done()` returns the finished output (e.g. its manifest) or None. While another live run holds
    the lease this waits, showing who holds it; the block's lease is released when it exits.
    """
    files = _Files(output)
    holder = f"{os.environ.get('USER', 'user')}@{socket.gethostname()}:{os.getpid()}"
    seen: tuple[int, int] | None = None  # (epoch, beat) of a live holder, and since when (our clock)
    seen_at = last_log = 0.0
    while True:
        result = done()
        if result is not None:
            yield result, None
            return
        newest = files.newest()
        epoch = newest.epoch if newest else 0
        body = newest.body if newest else {}
        state = (epoch, body.get("beat", -1))
        now = time.monotonic()
        if state != seen:
            seen, seen_at = state, now
        gone = _holder_gone(body)
        # A holder started with a longer timeout beats less often: never take its lease between two beats.
        limit = max(timeout, 4 * body.get("beat_every", 0))
        free = newest is None or body.get("released") or gone or now - seen_at >= limit
        if free:
            if newest is not None and not body.get("released"):
                why = "which has exited" if gone else f"silent for {now - seen_at:.0f}s"
                log(f"taking over {what} from {body.get('holder', 'a run')}, {why}")
            every = max(timeout / 4, 0.05)
            mine = {"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "what": what,
                    "since": _now(), "beat": 0, "beat_every": every, "released": False}
            if files.create(epoch + 1, mine):
                result = done()  # finished between our check and our create: nothing to do
                lease = Lease(files, epoch + 1, mine, every, log)
                if result is not None:
                    lease.release(finished=True)
                    yield result, None
                    return
                finished = False
                try:
                    yield None, lease
                    finished = done() is not None
                finally:
                    lease.release(finished)
                return
            continue  # another run created that number first
        if now - last_log >= 30 or not last_log:
            last_log = now
            log(f"waiting for {what}, held by {body.get('holder', '?')} since {body.get('since', '?')} "
                f"(last heartbeat {now - seen_at:.0f}s ago)")
        time.sleep(poll)
