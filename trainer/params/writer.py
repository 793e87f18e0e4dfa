"""Writing param-only Orbax checkpoints: whole trees, and trees of LazyParams converted and written part by part.

The lazy writer builds on Orbax internals (a `type_handlers.NumpyHandler` subclass that writes each
part's zarr chunk file itself, with O_DIRECT). Where this Orbax lacks them, or they fail when the
handler is built, `save_lazy_params` fills each parameter whole in memory and saves the tree with
Orbax's public StandardCheckpointer instead: the same checkpoint, read the same way, with the whole
model in memory.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts  # orbax-checkpoint's own storage layer

from trainer.params import scan_layers
from trainer.params.reader import PARAMS_DIR, ReadOnce, ReadOnceLayer

Log = Callable[[str], None]


def save_params(directory: str | Path, params: Any) -> Path:
    """Write a param tree as an Orbax checkpoint at `directory/params` (Orbax finalises it atomically)."""
    path = Path(directory).absolute() / PARAMS_DIR
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params)
    return path


@dataclass(frozen=True)
class LazyParam:
    """A parameter written when it is saved, in `parts` equal slices along `axis`: `fill(out, k)` writes
    slice k into a contiguous `out`, which is then stored on its own (the array is chunked that way).
    Fills of different parts may run at once, in different threads."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fill: Callable[[np.ndarray, int], None]
    axis: int = 0
    parts: int = 1
    group: Any = None  # LazyParams of one group are written one after another (they share a source, say)

    def __post_init__(self) -> None:  # a part that is not a whole chunk would leave chunks unwritten (read as 0)
        ok = 0 <= self.axis < max(1, len(self.shape)) and self.parts >= 1
        if not ok or (self.shape[self.axis] if self.shape else 1) % self.parts:
            raise ValueError(f"a LazyParam of shape {self.shape} cannot be cut in {self.parts} parts along axis {self.axis}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def part_shape(self) -> tuple[int, ...]:
        return tuple(n // self.parts if i == self.axis else n for i, n in enumerate(self.shape))

    @property
    def part_nbytes(self) -> int:
        return self.nbytes // self.parts


def _chunk_file(directory: str, lazy: LazyParam, k: int) -> str:
    """Where part k of a LazyParam is stored: its zarr v2 chunk key, the chunk grid indices joined by '.'."""
    index = [k if axis == lazy.axis else 0 for axis in range(len(lazy.shape))] or [0]
    return os.path.join(directory, ".".join(map(str, index)))


def _write_file(path: str, data: np.ndarray) -> int:
    """Write a contiguous array's bytes to a new file at `path`; returns the open file, still to be synced.

    The bytes up to the last whole block go with O_DIRECT when `data` starts on a page: straight to the
    disk, skipping the page cache (on this machine buffered writes to new files ran at 0.35-0.4 GB/s,
    direct ones at 2.1-2.7 GB/s, benchmarks/RESULTS.md). The rest, or all of it where the file system
    refuses O_DIRECT, is written through the page cache.
    """
    view = memoryview(data.reshape(-1).view(np.uint8))
    direct = len(view) - len(view) % _PAGE if data.ctypes.data % _PAGE == 0 and _O_DIRECT else 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if direct:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
                _write_all(fd, view[:direct])
            except OSError as err:  # EINVAL: no O_DIRECT here, or not at this alignment: the page cache it is
                if err.errno != errno.EINVAL:
                    raise
                direct = 0
                os.lseek(fd, 0, os.SEEK_SET)
            finally:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        _write_all(fd, view[direct:])
        _start_writeback(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):  # a write may store fewer bytes than asked
        done += os.write(fd, view[done:])


_PAGE = mmap.PAGESIZE  # O_DIRECT needs the buffer, offset and length aligned to the disk's block, which a
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # page is on common disks (else EINVAL, and the page cache is used)


def _start_writeback(fd: int) -> None:
    """Have the kernel start writing the file's pages to disk now, without waiting for it (Linux only).

    Not in Python's os module. The fsync that follows later then finds the data mostly written, and
    writes go on meanwhile: 229 MB of buffered writes in 73 files took 0.09 s this way against 0.60 s
    with each fsync started as its write ended (median of 8, benchmarks/RESULTS.md).
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE: the whole file, asynchronously


def _libc_sync_file_range() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except AttributeError:  # not Linux
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_sync_file_range = _libc_sync_file_range()


def _sync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_directory(path: str) -> None:
    """Make the directory's new entries durable (fsync of the files alone does not)."""
    _sync_and_close(os.open(path, os.O_RDONLY))


def _lazy_param_handler() -> Any:
    """A handler that writes LazyParams, built on Orbax internals: raises AttributeError, ImportError or
    TypeError where this Orbax version lacks them or changed their signatures."""
    from orbax.checkpoint import future as ocp_future
    from orbax.checkpoint import type_handlers

    # Looked up now, so that an Orbax without them falls back before anything is written.
    tspec_write = type_handlers.get_json_tspec_write
    commit_future = ocp_future.CommitFutureAwaitingContractedSignals

    class LazyParamHandler(type_handlers.NumpyHandler):
        """Writes LazyParams part by part, each part one chunk file of an uncompressed zarr array.

        Tensorstore creates each array (its .zarray); the chunks are written here. An uncompressed zarr v2
        chunk is just the part's bytes, so each part is filled into a slot of a reused ring and written from
        there, while the next parts are filled (by two threads: `fill` must allow that); fsyncs come last.
        Tensorstore's own write first copied every part into freshly allocated memory, then through the
        page cache; with our writes (and two fill threads) ingest runs 1.4-1.7x as fast (benchmarks/RESULTS.md).

        Stored exactly as Orbax stores a numpy array (type 'np.ndarray', chunked by part), so any restore
        reads it unchanged.
        """

        def __init__(self) -> None:
            super().__init__(deepcopy_host_arrays=False)

        async def serialize(self, values: Any, infos: Any, args: Any = None) -> list[ocp_future.Future]:
            largest = max((v.part_nbytes for v in values), default=0)

            async def write_all() -> None:
                # Opened (their metadata written) all at once: one by one, each open waits for the writes before it.
                directories = await asyncio.gather(*(self._open(lazy, info) for lazy, info in zip(values, infos)))
                group = lambda i: i if values[i].group is None else values[i].group  # noqa: E731
                first: dict[Any, int] = {}
                for i in range(len(values)):
                    first.setdefault(group(i), i)
                order = sorted(range(len(values)), key=lambda i: (first[group(i)], i))  # a group's params together
                parts = [(values[i], directories[i], k) for i in order for k in range(values[i].parts)]
                loop = asyncio.get_running_loop()
                slot = -(-largest // _PAGE) * _PAGE  # each slot page-aligned, for O_DIRECT
                ring = np.frombuffer(mmap.mmap(-1, _RING_SLOTS * slot), np.uint8)
                writes: list[asyncio.Future | None] = [None] * _RING_SLOTS  # the write still reading each slot
                unsynced: collections.deque[asyncio.Future] = collections.deque()  # writes of files not yet synced
                with (ThreadPoolExecutor(_FILL_THREADS, thread_name_prefix="maxpipe-fill") as filler,
                      ThreadPoolExecutor(_WRITE_THREADS, thread_name_prefix="maxpipe-write") as writer,
                      ThreadPoolExecutor(_SYNC_THREADS, thread_name_prefix="maxpipe-fsync") as syncer):

                    async def fill_and_write(lazy: LazyParam, k: int, part: np.ndarray, path: str) -> int:
                        await loop.run_in_executor(filler, lazy.fill, part, k)
                        return await loop.run_in_executor(writer, _write_file, path, part)

                    async def sync(written: asyncio.Future) -> None:
                        await loop.run_in_executor(syncer, _sync_and_close, await written)

                    try:
                        for n, (lazy, directory, k) in enumerate(parts):
                            i = n % _RING_SLOTS
                            if writes[i] is not None:
                                await writes[i]
                            part = ring[i * slot :][: lazy.part_nbytes].view(lazy.dtype).reshape(lazy.part_shape)
                            path = _chunk_file(directory, lazy, k)
                            writes[i] = asyncio.ensure_future(fill_and_write(lazy, k, part, path))
                            unsynced.append(writes[i])
                            if len(unsynced) > _MAX_OPEN_FILES:
                                await sync(unsynced.popleft())
                    finally:  # every write finished and every file synced and closed, also after a failure
                        outcomes = await asyncio.gather(*map(sync, unsynced), return_exceptions=True)
                    for outcome in outcomes:
                        if isinstance(outcome, BaseException):
                            raise outcome
                    await asyncio.gather(*(loop.run_in_executor(syncer, _sync_directory, d) for d in set(directories)))

            return [commit_future(write_all(), name="lazy_params")]

        async def _open(self, lazy: LazyParam, info: Any) -> str:
            """Create the array NumpyHandler would write, in chunks of one part each; returns its directory."""
            await info.await_path_creation()
            spec = tspec_write(
                info, use_ocdbt=False, global_shape=lazy.shape, local_shape=lazy.shape, dtype=lazy.dtype,
                metadata_key=self._metadata_key,
            )
            # Orbax's chunking heuristic (SaveArgs.chunk_byte_size) may split another axis than the parts' one.
            spec["metadata"]["chunks"] = list(lazy.part_shape)
            store = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
            written = store.spec().to_json()
            meta, kvstore = written["metadata"], written["kvstore"]
            raw = (written["driver"] == "zarr" and kvstore["driver"] == "file" and meta["compressor"] is None
                   and not meta.get("filters") and meta.get("order", "C") == "C"
                   and meta.get("dimension_separator", ".") == "." and sys.byteorder == "little")
            if not raw:  # the chunk files written here would not be what tensorstore reads
                raise RuntimeError(f"lazy params need an uncompressed zarr v2 array in local files, got {written}")
            return kvstore["path"]

    return LazyParamHandler()


_FILL_THREADS = 2  # parts filled at once: on 2 cores, 0.37 s against 0.70 s for 845 MB of transposes
_WRITE_THREADS = 2  # parts written at once: two keep the disk busier (6 % faster than one)
_RING_SLOTS = _FILL_THREADS + _WRITE_THREADS  # parts in memory: those being filled and those being written
_SYNC_THREADS = 2  # fsyncs in flight: the disk, not the CPU, is what they wait for
_MAX_OPEN_FILES = 64  # parts written and not yet synced


def save_lazy_params(directory: str | Path, params: Any, log: Log = print) -> Path:
    """Write a tree of LazyParams as the param-only checkpoint at `directory/params`.

    Holds four parts in memory: two being filled, two being written. Uncompressed (each chunk file is a
    part's bytes): zstd gains little on weights and cost a third of the write time.
    """
    path = Path(directory).absolute() / PARAMS_DIR
    try:
        from orbax.checkpoint import type_handlers

        # jax.Array's handler too, though no leaf is one: Orbax warns when a registry lacks it.
        registry = type_handlers.create_type_handler_registry(
            (LazyParam, _lazy_param_handler()), (jax.Array, type_handlers.ArrayHandler())
        )
        # One file per part rather than OCDBT's shared files, which only tensorstore can write; the
        # checkpoint reads the same either way.
        handler = ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False, use_zarr3=False,
                                              type_handler_registry=registry)
    except (AttributeError, ImportError, TypeError) as err:
        log(f"param writer: this Orbax lacks what the direct writer builds on ({type(err).__name__}: {err}); "
            f"saving through Orbax's StandardCheckpointer, with the whole model in memory")
        return _save_filled(path, params)
    # Orbax tries an OCDBT merge after every save and warns when there was nothing to merge.
    quiet = _Without("Skipping merge of OCDBT checkpoints")
    logging.getLogger("absl").addFilter(quiet)
    try:
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(path, args=ocp.args.PyTreeSave(params), force=True)
    finally:
        logging.getLogger("absl").removeFilter(quiet)
    return path


def _save_filled(path: Path, params: Any) -> Path:
    """The fallback: every LazyParam filled into a whole array, the tree saved by Orbax's public API."""
    arrays = jax.tree.map(_filled, params, is_leaf=lambda x: isinstance(x, LazyParam))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, arrays, force=True)
    return path


def _filled(lazy: LazyParam) -> np.ndarray:
    """The whole parameter, filled part by part as the direct writer would."""
    out = np.empty(lazy.shape, lazy.dtype)
    if lazy.parts == 1:
        lazy.fill(out, 0)
        return out
    part, rows = np.empty(lazy.part_shape, lazy.dtype), lazy.part_shape[lazy.axis]
    for k in range(lazy.parts):
        lazy.fill(part, k)
        index = [slice(None)] * len(lazy.shape)
        index[lazy.axis] = slice(k * rows, (k + 1) * rows)
        out[tuple(index)] = part
    return out


class _Without(logging.Filter):
    """Drops log records that contain `text`."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def lazy_copies(tree: Any, dtype: str = "", unscanned: bool = False, part_bytes: int = 16 << 20) -> Any:
    """LazyParams that copy a param tree (of StoredArrays, say) in `dtype` ("" keeps theirs) when saved,
    unscanned if asked (trainer/params/scan_layers.py), in parts of whole rows of at most `part_bytes`.

    Each array is read whole, once, and let go when its last part is written: a checkpoint's chunks are
    its shards, not its layers, so reading a layer at a time would read the chunk around it again for
    every layer.
    """
    readers = jax.tree.map(lambda x: ReadOnce(x, uses=0), tree)  # uses are counted as the parts are made

    def lazy(x: ReadOnce | ReadOnceLayer) -> LazyParam:
        out = np.dtype(dtype) if dtype and np.issubdtype(x.dtype, np.floating) else x.dtype
        source, layer = (x.source, x.index) if isinstance(x, ReadOnceLayer) else (x, None)
        rows = x.shape[0] if x.shape else 1
        parts = split(rows, math.prod(x.shape) * out.itemsize, part_bytes)
        source.uses += parts
        return LazyParam(x.shape, out, partial(_copy_into, source, layer, rows // parts), parts=parts, group=source)

    return jax.tree.map(lazy, scan_layers.unscan(readers) if unscanned else readers)


def split(rows: int, nbytes: int, part_bytes: int, max_parts: int = 256) -> int:
    """Into how many equal parts of whole rows to cut an array of `rows` rows and `nbytes` bytes: the
    fewest of at most `part_bytes` each, else as many as can be up to `max_parts` (each a chunk file)."""
    counts = [p for p in range(1, min(rows, max_parts) + 1) if rows % p == 0]
    return next((p for p in counts if nbytes // p <= part_bytes), counts[-1])


def _copy_into(source: ReadOnce, layer: int | None, rows: int, out: np.ndarray, part: int) -> None:
    value = source.read(layer)
    np.copyto(out, value[part * rows : (part + 1) * rows] if value.ndim else value, casting="unsafe")
