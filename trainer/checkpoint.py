"""Orbax checkpoints: param-only trees (ingest, export) and full train state (periodic, final)."""

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
import threading
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
from orbax.checkpoint import future as ocp_future
from orbax.checkpoint import type_handlers

from configs import ModelConfig, UserError
from trainer import layout

PARAMS_DIR = "params"


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


class _LazyParamHandler(type_handlers.NumpyHandler):
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
                        writes[i] = asyncio.ensure_future(fill_and_write(lazy, k, part, _chunk_file(directory, lazy, k)))
                        unsynced.append(writes[i])
                        if len(unsynced) > _MAX_OPEN_FILES:
                            await sync(unsynced.popleft())
                finally:  # every write finished and every file synced and closed, also after a failure
                    outcomes = await asyncio.gather(*map(sync, unsynced), return_exceptions=True)
                for outcome in outcomes:
                    if isinstance(outcome, BaseException):
                        raise outcome
                await asyncio.gather(*(loop.run_in_executor(syncer, _sync_directory, d) for d in set(directories)))

        return [ocp_future.CommitFutureAwaitingContractedSignals(write_all(), name="lazy_params")]

    async def _open(self, lazy: LazyParam, info: Any) -> str:
        """Create the array NumpyHandler would write, in chunks of one part each; returns its directory."""
        await info.await_path_creation()
        spec = type_handlers.get_json_tspec_write(
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


_FILL_THREADS = 2  # parts filled at once: on 2 cores, 0.37 s against 0.70 s for 845 MB of transposes
_WRITE_THREADS = 2  # parts written at once: two keep the disk busier (6 % faster than one)
_RING_SLOTS = _FILL_THREADS + _WRITE_THREADS  # parts in memory: those being filled and those being written
_SYNC_THREADS = 2  # fsyncs in flight: the disk, not the CPU, is what they wait for
_MAX_OPEN_FILES = 64  # parts written and not yet synced


def save_lazy_params(directory: str | Path, params: Any) -> Path:
    """Write a tree of LazyParams as the param-only checkpoint at `directory/params`.

    Holds four parts in memory: two being filled, two being written. Uncompressed (each chunk file is a
    part's bytes): zstd gains little on weights and cost a third of the write time.
    """
    path = Path(directory).absolute() / PARAMS_DIR
    # jax.Array's handler too, though no leaf is one: Orbax warns when a registry lacks it.
    registry = type_handlers.create_type_handler_registry(
        (LazyParam, _LazyParamHandler()), (jax.Array, type_handlers.ArrayHandler())
    )
    # One file per part rather than OCDBT's shared files, which only tensorstore can write; the
    # checkpoint reads the same either way.
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False, use_zarr3=False,
                                          type_handler_registry=registry)
    # Orbax tries an OCDBT merge after every save and warns when there was nothing to merge.
    quiet = _Without("Skipping merge of OCDBT checkpoints")
    logging.getLogger("absl").addFilter(quiet)
    try:
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(path, args=ocp.args.PyTreeSave(params), force=True)
    finally:
        logging.getLogger("absl").removeFilter(quiet)
    return path


class _Without(logging.Filter):
    """Drops log records that contain `text`."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def load_params(directory: str | Path, abstract: Any | None = None) -> Any:
    """Read a param tree from `directory/params`; with `abstract` (shapes/dtypes/shardings) it is checked and placed.

    The checkpoint may hold the unscanned layout or another float dtype (see trainer/layout.py): it is
    then read as stored, restacked and cast to what `abstract` asks for.
    """
    path = Path(directory).absolute() / PARAMS_DIR
    if not path.is_dir():
        raise UserError(f"no parameter checkpoint at {path}")
    with ocp.StandardCheckpointer() as ckptr:
        if abstract is None:
            return ckptr.restore(path)
        stored = ckptr.metadata(path).item_metadata.tree
        dtypes = {str(x.dtype) for x in jax.tree.leaves(stored)} - {str(x.dtype) for x in jax.tree.leaves(abstract)}
        if not layout.is_unscanned(stored) and not dtypes:
            check_shapes(stored, abstract)
            return ckptr.restore(path, abstract)
        params = layout.rescan(ckptr.restore(path))
    check_shapes(params, abstract)
    return jax.tree.map(lambda x, a: jax.device_put(np.asarray(x, a.dtype), a.sharding), params, abstract)


def check_shapes(stored: Any, expected: Any) -> None:
    """Raise one UserError line naming the parameters whose shapes differ between two trees (the first five)."""
    got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(stored)}
    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    wrong = [name for name in sorted(set(got) | set(want)) if got.get(name) != want.get(name)]
    if wrong:
        details = "; ".join(
            f"{name} is {got.get(name, 'missing')} in the checkpoint but {want.get(name, 'absent')} in the model"
            for name in wrong[:5]
        )
        more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
        raise UserError(f"checkpoint does not fit the model config: {len(wrong)} parameter(s) differ: {details}{more}")


def abstract_params(cfg: ModelConfig, seq_len: int = 8) -> Any:
    """Shapes and dtypes of the model's parameters, without allocating them."""
    import jax.numpy as jnp
    import flax.linen as nn

    from trainer.model import Transformer

    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)["params"]
    return nn.unbox(boxed)


CHECKPOINTS_DIR = "checkpoints"


def train_checkpoints(run_dir: str | Path, keep: int = 2) -> ocp.CheckpointManager:
    """Full-state checkpoints under `run_dir/checkpoints`: params, optimizer state, data iterator.

    Orbax writes each step asynchronously to a temporary directory and renames it when complete,
    so a crash never leaves a partial checkpoint that looks finished; older steps are deleted
    only after a newer one is whole.
    """
    import grain

    return ocp.CheckpointManager(
        Path(run_dir).absolute() / CHECKPOINTS_DIR,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True),
        item_handlers={
            "params": ocp.StandardCheckpointHandler(),
            "opt_state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
        },
    )


def save_train_state(manager: ocp.CheckpointManager, step: int, params: Any, opt_state: Any, data_iter: Any) -> None:
    """Start writing a full checkpoint for `step` (returns before the write finishes)."""
    import grain

    manager.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            data=grain.checkpoint.CheckpointSave(data_iter),
        ),
        force=True,
    )


def restore_train_state(
    manager: ocp.CheckpointManager, step: int, abstract_params: Any, abstract_opt_state: Any, data_iter: Any
) -> tuple[Any, Any]:
    """Restore params, optimizer state and (in place) the data iterator from `step`."""
    import grain

    check_shapes(manager.item_metadata(step)["params"], abstract_params)
    data_dir = manager.directory / str(step) / "data"
    count = jax.process_count()
    if not (data_dir / f"process_{jax.process_index()}-of-{count}.json").exists():
        raise UserError(
            f"checkpoint {step} in {manager.directory} was written by a run with a different number of processes "
            f"than this one ({count}): its data iterator state cannot be split again; resume with the same process count"
        )
    # Params and optimizer state are restored straight into the current mesh's shardings (any mesh shape).
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params),
            opt_state=ocp.args.StandardRestore(abstract_opt_state),
            data=grain.checkpoint.CheckpointRestore(data_iter),
        ),
    )
    return restored["params"], restored["opt_state"]


@dataclass(frozen=True)
class StoredArray:
    """An array of a checkpoint on disk, read when np.asarray asks for it."""

    store: Any  # a tensorstore (or a view of one)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.store.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.store.dtype.numpy_dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self.store.read().result()
        return value if dtype is None else value.astype(dtype)


def stored_params(directory: str | Path) -> Any:
    """The param tree of the Orbax checkpoint at `directory` as StoredArrays, nothing read yet."""
    path = Path(directory).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.metadata(path).item_metadata.tree
    ocdbt = type_handlers.is_ocdbt_checkpoint(path)
    context = type_handlers.get_ts_context(use_ocdbt=ocdbt)

    def open_array(meta: Any) -> StoredArray:
        errors = []
        for zarr3 in (False, True):  # Orbax writes zarr (v2) unless told otherwise; its metadata does not say
            info = type_handlers.ParamInfo(name=meta.name, parent_dir=path, is_ocdbt_checkpoint=ocdbt,
                                           use_zarr3=zarr3, ts_context=context)
            try:
                spec = type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
                return StoredArray(ts.open(ts.Spec(spec), read=True, context=context).result())
            except ValueError as err:
                errors.append(str(err))
        raise UserError(f"cannot read {meta.name} in {path}: {errors[-1]}")

    return jax.tree.map(open_array, tree)


def latest_stored_params(run_dir: str | Path, abstract: Any) -> tuple[int, Any]:
    """The step and the params (StoredArrays) of the newest complete checkpoint of a training run."""
    path = Path(run_dir).absolute() / CHECKPOINTS_DIR
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
                                    item_handlers={"params": ocp.StandardCheckpointHandler()})
    step = manager.latest_step()
    if step is None:
        raise UserError(f"no complete training checkpoint in {path}")
    check_shapes(manager.item_metadata(step)["params"], abstract)
    manager.close()
    return step, stored_params(path / str(step) / "params")


class ReadOnce:
    """An array read (or copied to host) once, however often it or its layers are asked for; let go after `uses` reads."""

    def __init__(self, array: Any, uses: int = 1) -> None:
        self.array, self.uses, self.value = array, uses, None
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.lock = threading.Lock()  # layers are read by parallel fills

    def __getitem__(self, layer: int) -> _Layer:
        return _Layer(self, layer)

    def read(self, layer: int | None = None) -> np.ndarray:
        with self.lock:
            if self.value is None:
                self.value = np.asarray(self.array)
            out = self.value if layer is None else self.value[layer]
            self.uses -= 1
            if not self.uses:
                self.value = None
        return out


@dataclass(frozen=True)
class _Layer:
    """Layer `index` of a ReadOnce's array, not read yet."""

    source: ReadOnce
    index: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape[1:]

    @property
    def dtype(self) -> np.dtype:
        return self.source.dtype


def lazy_copies(tree: Any, dtype: str = "", unscanned: bool = False, part_bytes: int = 16 << 20) -> Any:
    """LazyParams that copy a param tree (of StoredArrays, say) in `dtype` ("" keeps theirs) when saved,
    in the unscanned layout if asked (trainer/layout.py), in parts of whole rows of at most `part_bytes`.

    Each array is read whole, once, and let go when its last part is written: a checkpoint's chunks are
    its shards, not its layers, so reading a layer at a time would read the chunk around it again for
    every layer.
    """
    readers = jax.tree.map(lambda x: ReadOnce(x, uses=0), tree)  # uses are counted as the parts are made

    def lazy(x: ReadOnce | _Layer) -> LazyParam:
        out = np.dtype(dtype) if dtype and np.issubdtype(x.dtype, np.floating) else x.dtype
        source, layer = (x.source, x.index) if isinstance(x, _Layer) else (x, None)
        rows = x.shape[0] if x.shape else 1
        parts = split(rows, math.prod(x.shape) * out.itemsize, part_bytes)
        source.uses += parts
        return LazyParam(x.shape, out, partial(_copy_into, source, layer, rows // parts), parts=parts, group=source)

    return jax.tree.map(lazy, layout.unscan(readers) if unscanned else readers)


def split(rows: int, nbytes: int, part_bytes: int, max_parts: int = 256) -> int:
    """Into how many equal parts of whole rows to cut an array of `rows` rows and `nbytes` bytes: the
    fewest of at most `part_bytes` each, else as many as can be up to `max_parts` (each a chunk file)."""
    counts = [p for p in range(1, min(rows, max_parts) + 1) if rows % p == 0]
    return next((p for p in counts if nbytes // p <= part_bytes), counts[-1])


def _copy_into(source: ReadOnce, layer: int | None, rows: int, out: np.ndarray, part: int) -> None:
    value = source.read(layer)
    np.copyto(out, value[part * rows : (part + 1) * rows] if value.ndim else value, casting="unsafe")
