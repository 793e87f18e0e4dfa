"""Orbax checkpoints: param-only trees (ingest, export) and full train state (periodic, final)."""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import math
import weakref
from collections.abc import Callable
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
    slice k into a contiguous `out`, which is then stored on its own (the array is chunked that way)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fill: Callable[[np.ndarray, int], None]
    axis: int = 0
    parts: int = 1
    group: Any = None  # LazyParams of one group are written one after another (they share a source, say)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def part_shape(self) -> tuple[int, ...]:
        return tuple(n // self.parts if i == self.axis else n for i, n in enumerate(self.shape))

    @property
    def part_nbytes(self) -> int:
        return self.nbytes // self.parts

    def part(self, k: int) -> tuple[slice, ...]:
        """Where slice k lies in the parameter."""
        n = self.shape[self.axis] // self.parts
        return (slice(None),) * self.axis + (slice(k * n, (k + 1) * n),)


def _release_freed_memory() -> None:
    """Hand memory freed by tensorstore's written copies back to the OS.

    glibc keeps freed blocks of this size in its per-thread heaps (after the first free it stops mapping
    them), and with tensorstore's threads RSS crept to 0.6x the model (benchmarks/RESULTS.md).
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass


class _Ring:
    """A ring buffer of parts: a part's bytes are reused once tensorstore has copied them out.

    Reused, not allocated per part, because first-touching fresh memory costs more than the copy into
    it (numbers in benchmarks/RESULTS.md).
    """

    def __init__(self, size: int) -> None:
        self.buffer, self.head = np.empty(size, np.uint8), 0
        self.copying: collections.deque[tuple[int, int, Any, weakref.ref]] = collections.deque()

    async def take(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Room for `nbytes` after the last part taken, waiting for the oldest copies until it is free."""
        start = self.head if self.head + nbytes <= self.buffer.nbytes else 0
        while any(s < start + nbytes and start < e for s, e, _, _ in self.copying):
            if not await self._finish(*self.copying.popleft()):
                await self.drain()  # tensorstore kept a part: leave this buffer to it and go on in a new one
                self.buffer, start = np.empty(self.buffer.nbytes, np.uint8), 0
                break
        self.head = start + nbytes
        return start, self.buffer[start : start + nbytes]

    def copied_when(self, start: int, part: np.ndarray, copy: Any) -> None:
        self.copying.append((start, start + part.nbytes, copy, weakref.ref(part)))

    async def drain(self) -> None:
        while self.copying:
            await self._finish(*self.copying.popleft())

    @staticmethod
    async def _finish(start: int, end: int, copy: Any, part: weakref.ref) -> bool:
        """Wait for a copy; True once tensorstore has also let go of its source (it may, a moment after)."""
        await copy
        for _ in range(1000):
            if part() is None:
                return True
            await asyncio.sleep(0.001)
        return False


class _LazyParamHandler(type_handlers.NumpyHandler):
    """Writes LazyParams part by part: each is filled into a ring buffer and handed to tensorstore,
    which copies it and writes it out while the next parts are filled.

    At most max(max_bytes, the largest part) is handed over and not yet on disk. Stored exactly as Orbax
    stores a numpy array (type 'np.ndarray', chunked by part), so any restore reads it unchanged.
    """

    def __init__(self, max_bytes: int) -> None:
        super().__init__(deepcopy_host_arrays=False)
        self.max_bytes = max_bytes

    async def serialize(self, values: Any, infos: Any, args: Any = None) -> list[ocp_future.Future]:
        largest = max((v.part_nbytes for v in values), default=0)
        ring = _Ring(2 * largest)  # filling one part while tensorstore copies the last
        limit = max(self.max_bytes, largest)

        async def write_all() -> None:
            writing: collections.deque[tuple[int, Any]] = collections.deque()  # handed over, not yet on disk
            held = 0
            try:
                # Opened (their metadata written) all at once: one by one, each open waits for the writes before it.
                stores = await asyncio.gather(*(self._open(lazy, info) for lazy, info in zip(values, infos)))
                first: dict[Any, int] = {}
                for i, lazy in enumerate(values):
                    first.setdefault(i if lazy.group is None else lazy.group, i)
                order = sorted(range(len(values)), key=lambda i: (first[i if values[i].group is None else values[i].group], i))
                for lazy, store in ((values[i], stores[i]) for i in order):
                    for k in range(lazy.parts):
                        start, raw = await ring.take(lazy.part_nbytes)
                        part = raw.view(lazy.dtype).reshape(lazy.part_shape)
                        await asyncio.to_thread(lazy.fill, part, k)
                        if held + lazy.part_nbytes > limit:  # wait until enough is on disk
                            while held + lazy.part_nbytes > limit:
                                nbytes, commit = writing.popleft()
                                await commit
                                held -= nbytes
                            _release_freed_memory()
                        # Copied by tensorstore: faster than letting it reference the part (measured), and it
                        # frees the part for the next fill at once.
                        write = store[lazy.part(k)].write(part)
                        ring.copied_when(start, part, write.copy)
                        writing.append((lazy.part_nbytes, write.commit))
                        held += lazy.part_nbytes
                        del part, raw
            finally:  # also after a failure: no write may outlive its source
                await ring.drain()
                for _, commit in writing:
                    await commit

        return [ocp_future.CommitFutureAwaitingContractedSignals(write_all(), name="lazy_params")]

    async def _open(self, lazy: LazyParam, info: Any) -> Any:
        """The tensorstore NumpyHandler would write to (its spec), in chunks of one part each."""
        await info.await_path_creation()
        ocdbt = info.is_ocdbt_checkpoint
        spec = type_handlers.get_json_tspec_write(
            info, use_ocdbt=ocdbt, global_shape=lazy.shape, local_shape=lazy.shape, dtype=lazy.dtype,
            process_index=jax.process_index() if ocdbt else None, metadata_key=self._metadata_key,
        )
        # Orbax's chunking heuristic (SaveArgs.chunk_byte_size) may split another axis than the parts' one.
        spec["metadata"]["chunks"] = list(lazy.part_shape)
        return await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)


def save_lazy_params(directory: str | Path, params: Any, max_bytes: int = 0) -> Path:
    """Write a tree of LazyParams as the param-only checkpoint at `directory/params`.

    Holds two parts being filled and at most max(max_bytes, the largest part) handed to tensorstore and
    not yet on disk. Uncompressed: zstd gains little on weights and cost a third of the write time.
    """
    path = Path(directory).absolute() / PARAMS_DIR
    # jax.Array's handler too, though no leaf is one: Orbax warns when a registry lacks it.
    registry = type_handlers.create_type_handler_registry(
        (LazyParam, _LazyParamHandler(max_bytes)), (jax.Array, type_handlers.ArrayHandler())
    )
    # One file per part rather than OCDBT's shared files: with OCDBT the same ingest took 1.4-2x as long
    # (its commits wait on each other); the checkpoint reads the same either way.
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
    """An array read (or copied to host) once, however many of its layers are asked for; let go after `uses`."""

    def __init__(self, array: Any, uses: int = 1) -> None:
        self.array, self.uses, self.value = array, uses, None
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)

    def __getitem__(self, layer: int) -> _Layer:
        return _Layer(self, layer)

    def read(self, layer: int | None = None) -> np.ndarray:
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


def lazy_copies(tree: Any, dtype: str = "", unscanned: bool = False) -> Any:
    """LazyParams that copy a param tree (of StoredArrays, say) in `dtype` ("" keeps theirs) when saved,
    in the unscanned layout if asked (trainer/layout.py).

    Each array is read whole, once, and let go when written: a checkpoint's chunks are its shards, not
    its layers, so reading a layer at a time would read the chunk around it again for every layer.
    """
    stacked = lambda path: getattr(path[0], "key", None) == "layers"  # noqa: E731
    readers = jax.tree_util.tree_map_with_path(
        lambda path, x: ReadOnce(x, x.shape[0] if unscanned and stacked(path) else 1), tree)

    def lazy(x: ReadOnce | _Layer) -> LazyParam:
        out = np.dtype(dtype) if dtype and np.issubdtype(x.dtype, np.floating) else x.dtype
        source, layer = (x.source, x.index) if isinstance(x, _Layer) else (x, None)
        return LazyParam(x.shape, out, partial(_copy_into, source, layer), group=source)

    return jax.tree.map(lazy, layout.unscan(readers) if unscanned else readers)


def _copy_into(source: ReadOnce, layer: int | None, out: np.ndarray, part: int) -> None:
    np.copyto(out, source.read(layer), casting="unsafe")
