"""The trainer's scanned param tree <-> the per-layer (unscanned) one, and the float cast of exports.

The trainer keeps each block's parameters stacked on a leading axis under `layers` (one `nn.scan`);
tools that walk layers one by one (and MaxText's unscanned checkpoints) want `layers_0`,
`layers_1`, ... instead. `unscan` and `rescan` convert between the two, losslessly.
"""

from __future__ import annotations

import re
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


def is_unscanned(params: dict[str, Any]) -> bool:
    """Whether a tree has per-layer subtrees (`layers_0`, ...) rather than stacked `layers`."""
    return "layers" not in params and any(_LAYER.fullmatch(k) for k in params)


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

