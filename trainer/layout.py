"""Parameter layouts and dtypes of exports: the trainer's scanned tree and the per-layer (unscanned) one.

The trainer keeps each block's parameters stacked on a leading axis under `layers` (one `nn.scan`);
tools that walk layers one by one (and MaxText's unscanned checkpoints) want `layers_0`,
`layers_1`, ... instead. `unscan` and `rescan` convert between the two, losslessly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

_LAYER = re.compile(r"layers_(\d+)")


def unscan(params: dict[str, Any]) -> dict[str, Any]:
    """`layers` [n, ...] -> `layers_0` ... `layers_{n-1}`."""
    out = {k: v for k, v in params.items() if k != "layers"}
    stacked = params["layers"]
    count = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    for i in range(count):
        out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return out


def rescan(params: dict[str, Any]) -> dict[str, Any]:
    """`layers_0` ... `layers_{n-1}` -> `layers` [n, ...]; a scanned tree is returned as it is."""
    indices = sorted(int(m.group(1)) for k in params if (m := _LAYER.fullmatch(k)))
    if not indices:
        return params
    out = {k: v for k, v in params.items() if not _LAYER.fullmatch(k)}
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[f"layers_{i}"] for i in indices))
    return out


def cast(params: Any, dtype: str) -> Any:
    """Every floating-point leaf in `dtype` ("" keeps them as they are)."""
    if not dtype:
        return params
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def load_params(directory: str | Path, abstract: Any) -> Any:
    """Params from `directory/params` in either layout and any float dtype, checked and placed like `abstract`."""
    import orbax.checkpoint as ocp

    from trainer import checkpoint

    path = Path(directory).absolute() / checkpoint.PARAMS_DIR
    if path.is_dir():
        with ocp.StandardCheckpointer() as ckptr:
            stored = ckptr.metadata(path).item_metadata.tree
        unscanned = "layers" not in stored and any(_LAYER.fullmatch(k) for k in stored)
        dtypes = {str(x.dtype) for x in jax.tree.leaves(stored)} - {str(x.dtype) for x in jax.tree.leaves(abstract)}
        if unscanned or dtypes:
            # Read as stored, restack, and put each leaf where and as the trainer wants it.
            params = rescan(checkpoint.load_params(directory))
            checkpoint.check_shapes(params, abstract)
            return jax.tree.map(lambda x, a: jax.device_put(jnp.asarray(x, a.dtype), a.sharding), params, abstract)
    return checkpoint.load_params(directory, abstract)
