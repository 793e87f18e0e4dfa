"""Orbax checkpoints: param-only trees (ingest, export) and full train state (periodic, final)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from configs import ModelConfig, UserError

PARAMS_DIR = "params"


def save_params(directory: str | Path, params: Any) -> Path:
    """Write a param tree as an Orbax checkpoint at `directory/params` (Orbax finalises it atomically)."""
    path = Path(directory).absolute() / PARAMS_DIR
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params)
    return path


def load_params(directory: str | Path, abstract: Any | None = None) -> Any:
    """Read a param tree from `directory/params`; with `abstract` (shapes/dtypes/shardings) it is checked and placed."""
    path = Path(directory).absolute() / PARAMS_DIR
    if not path.is_dir():
        raise UserError(f"no parameter checkpoint at {path}")
    with ocp.StandardCheckpointer() as ckptr:
        if abstract is None:
            return ckptr.restore(path)
        check_shapes(ckptr.metadata(path).item_metadata.tree, abstract)
        return ckptr.restore(path, abstract)


def check_shapes(stored: Any, expected: Any) -> None:
    """Raise one UserError line naming the first parameter whose shape differs between two trees."""
    got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(stored)}
    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            raise UserError(
                f"checkpoint does not fit the model config: parameter {name} is "
                f"{got.get(name, 'missing')} in the checkpoint but {want.get(name, 'absent')} in the model"
            )


def abstract_params(cfg: ModelConfig, seq_len: int = 8) -> Any:
    """Shapes and dtypes of the model's parameters, without allocating them."""
    import jax.numpy as jnp
    import flax.linen as nn

    from trainer.model import Transformer

    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)["params"]
    return nn.unbox(boxed)
