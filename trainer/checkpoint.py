"""Orbax checkpoints: param-only trees (ingest, export) and full train state (periodic, final)."""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
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
    """A parameter that `fill(out)` writes into an array of its shape and dtype when it is saved."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fill: Callable[[np.ndarray], None]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class _LazyParamHandler(type_handlers.NumpyHandler):
    """Writes LazyParams one after another, each filled into a reused buffer just before its write.

    The buffer (an arena of max(max_bytes, largest parameter)) is reused because first-touching fresh
    memory costs more than the copy into it (numbers in benchmarks/RESULTS.md). The next parameter is
    filled (in a thread) while the current one is written when both fit in the arena side by side.
    Stored exactly as Orbax stores a numpy array (type 'np.ndarray'), so any restore reads it unchanged.
    """

    def __init__(self, max_bytes: int) -> None:
        # The arena is not touched while its slice is written: no defensive copy.
        super().__init__(deepcopy_host_arrays=False)
        self.max_bytes = max_bytes

    async def serialize(self, values: Any, infos: Any, args: Any = None) -> list[ocp_future.Future]:
        args = args or [type_handlers.SaveArgs()] * len(values)
        size = max([self.max_bytes, *(v.nbytes for v in values)])

        async def write_in_turn() -> None:
            arena = np.empty(size, np.uint8)

            def filled_at(lazy: LazyParam, out: np.ndarray) -> np.ndarray:
                lazy.fill(out)
                return out

            def fill(k: int, start: int) -> asyncio.Future:
                out = arena[start : start + values[k].nbytes].view(values[k].dtype).reshape(values[k].shape)
                return asyncio.ensure_future(asyncio.to_thread(filled_at, values[k], out))

            filled: asyncio.Future | None = fill(0, 0) if values else None
            try:
                for k, (info, arg) in enumerate(zip(infos, args)):
                    value = await (filled or fill(k, 0))
                    # Fill the next one beside this one (after it, else before it) when there is room.
                    start = value.ctypes.data - arena.ctypes.data
                    end, nxt = start + value.nbytes, None
                    if k + 1 < len(values):
                        n = values[k + 1].nbytes
                        nxt = end if end + n <= size else 0 if n <= start else None
                    filled = fill(k + 1, nxt) if nxt is not None else None
                    # NumpyHandler's own write of one array (its tensorstore spec, OCDBT, no copy of the source);
                    # its public serialize() wants every array of the batch made at once, which is what we avoid.
                    await self._background_serialize([value], [info], [arg])
                    written = weakref.ref(value)
                    del value
                    # Tensorstore may let go of the array a moment after the write completes: never fill over
                    # it before then (and if it keeps it, go on in a new arena).
                    for _ in range(1000):
                        if written() is None:
                            break
                        await asyncio.sleep(0.001)
                    else:
                        if filled is not None:
                            await asyncio.wait([filled])
                        arena, filled = np.empty(size, np.uint8), None
            finally:
                if filled is not None:  # a failed write leaves the next fill running: let it end first
                    await asyncio.wait([filled])

        return [ocp_future.CommitFutureAwaitingContractedSignals(write_in_turn(), name="lazy_params")]


def save_lazy_params(directory: str | Path, params: Any, max_bytes: int = 0) -> Path:
    """Write a tree of LazyParams as the param-only checkpoint at `directory/params`.

    Holds about max(max_bytes, the largest parameter) of them; with room for two, filling the next
    overlaps writing the last. Uncompressed: zstd gains little on weights and cost a third of the write time.
    """
    path = Path(directory).absolute() / PARAMS_DIR
    # jax.Array's handler too, though no leaf is one: Orbax warns when a registry lacks it.
    registry = type_handlers.create_type_handler_registry(
        (LazyParam, _LazyParamHandler(max_bytes)), (jax.Array, type_handlers.ArrayHandler())
    )
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(params), force=True)
    return path


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


def latest_trained_params(run_dir: str | Path, abstract: Any | None = None) -> tuple[int, Any]:
    """The step and params of the newest complete checkpoint of a training run (no optimizer state)."""
    path = Path(run_dir).absolute() / CHECKPOINTS_DIR
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
                                    item_handlers={"params": ocp.StandardCheckpointHandler()})
    step = manager.latest_step()
    if step is None:
        raise UserError(f"no complete training checkpoint in {path}")
    if abstract is not None:
        check_shapes(manager.item_metadata(step)["params"], abstract)
    params = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))["params"]
    manager.close()
    return step, params
