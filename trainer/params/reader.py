"""Reading param checkpoints: whole (load_params), or lazily as StoredArrays read once each; shape checks."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts  # orbax-checkpoint's own storage layer
from orbax.checkpoint import type_handlers

from configs import ModelConfig, UserError
from trainer.params import scan_layers

PARAMS_DIR = "params"  # the param-only checkpoint's directory in an ingest or export output


def load_params(directory: str | Path, abstract: Any | None = None) -> Any:
    """Read a param tree from `directory/params`; with `abstract` (shapes/dtypes/shardings) it is checked and placed.

    The checkpoint may be unscanned or hold another float dtype (see trainer/params/scan_layers.py): it is then
    read as stored, restacked and cast to what `abstract` asks for.
    """
    path = Path(directory).absolute() / PARAMS_DIR
    if not path.is_dir():
        raise UserError(f"no parameter checkpoint at {path}")
    with ocp.StandardCheckpointer() as ckptr:
        if abstract is None:
            return ckptr.restore(path)
        stored = ckptr.metadata(path).item_metadata.tree
        dtypes = {str(x.dtype) for x in jax.tree.leaves(stored)} - {str(x.dtype) for x in jax.tree.leaves(abstract)}
        if not scan_layers.is_unscanned(stored) and not dtypes:
            check_shapes(stored, abstract)
            return ckptr.restore(path, abstract)
        params = scan_layers.rescan(ckptr.restore(path))
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

    from trainer.model.decoder import Transformer

    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)["params"]
    return nn.unbox(boxed)


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


class ReadOnce:
    """An array read (or copied to host) once, however often it or its layers are asked for; let go after `uses` reads.

    A StoredArray asked for one layer (and expert) reads only that slice: an MoE layer's experts together are
    E times a dense MLP's weight, too much to hold whole.
    """

    def __init__(self, array: Any, uses: int = 1) -> None:
        self.array, self.uses, self.value = array, uses, None
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.lock = threading.Lock()  # layers are read by parallel fills

    def __getitem__(self, layer: int) -> ReadOnceLayer:
        return ReadOnceLayer(self, layer)

    def read(self, layer: int | None = None, expert: int | None = None) -> np.ndarray:
        index = tuple(i for i in (layer, expert) if i is not None)
        if index and isinstance(self.array, StoredArray):
            return np.asarray(StoredArray(self.array.store[index]))
        with self.lock:
            if self.value is None:
                self.value = np.asarray(self.array)
            out = self.value[index]
            self.uses -= 1
            if not self.uses:
                self.value = None
        return out


@dataclass(frozen=True)
class ReadOnceLayer:
    """Layer `index` of a ReadOnce's array, not read yet."""

    source: ReadOnce
    index: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape[1:]

    @property
    def dtype(self) -> np.dtype:
        return self.source.dtype
