"""Spill files: token ids parked on disk between tokenizing and packing.

Beam's local runners hold every element of a GroupByKey in the launcher's memory, so shipping token
ids through the per-shard grouping would hold the whole tokenized corpus there. Instead each tokenizing
worker bundle appends ids to one spill file per shard (in the staging folder: a local path, or a URL that
every Dataflow worker can read) and ships only (spill file, offset, length); the shard writer reads
them back in order. Spill files go when the staging folder does.
"""

from __future__ import annotations

import os
import tempfile
import uuid

import numpy as np

from data_prep import storage
from contract.records import DTYPE

_ITEM = np.dtype(DTYPE).itemsize


class SpillWriter:
    """Appends id arrays to one new file under `folder`; `close` uploads it when folder is a URL."""

    def __init__(self, folder: str, prefix: str):
        name = f"{prefix}-{uuid.uuid4().hex}.spill"
        self.path = str(storage.join(folder, name))
        self._tmp = tempfile.TemporaryDirectory(prefix="maxpipe-spill-") if storage.is_url(folder) else None
        self._local = os.path.join(self._tmp.name, name) if self._tmp else self.path
        self._file = open(self._local, "wb")  # noqa: SIM115 (open across append calls, closed in close)
        self._offset = 0

    def append(self, ids: np.ndarray) -> int:
        """Write ids; returns their offset (in ids) in the file."""
        offset = self._offset
        self._file.write(ids.astype(DTYPE, copy=False).tobytes())
        self._offset += len(ids)
        return offset

    def close(self) -> None:
        self._file.close()
        if self._tmp:
            storage.upload(self._local, self.path)
            self._tmp.cleanup()


class SpillReader:
    """Reads id ranges back; a URL spill file is downloaded once to a local temp folder."""

    def __init__(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="maxpipe-spill-")
        self._files: dict[str, object] = {}

    def read(self, path: str, offset: int, length: int) -> np.ndarray:
        f = self._files.get(path)
        if f is None:
            local = path
            if storage.is_url(path):
                local = os.path.join(self._tmp.name, f"{len(self._files)}.spill")
                storage.download(path, local)
            f = self._files[path] = open(local, "rb")  # noqa: SIM115 (kept for later reads, closed in close)
        f.seek(offset * _ITEM)
        return np.frombuffer(f.read(length * _ITEM), DTYPE)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._tmp.cleanup()
