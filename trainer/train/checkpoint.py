"""Full training-state Orbax checkpoints (params, optimizer state, data iterator): write, restore, read lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from configs import UserError
from trainer.params.reader import check_shapes, stored_params

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
