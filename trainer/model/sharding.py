"""The device mesh and the rules that map logical axis names onto it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import flax.linen as nn
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import UserError

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes batch rows are split over

# Logical axis -> mesh axes, first free rule wins (a mesh axis shards one dimension of an array). Batch splits
# over data, fsdp and expert; a sequence's tokens over context; MoE experts over expert; parameters shard their
# embed axis over fsdp (and expert, where that is not taken by the experts) and their heads/mlp/vocab axes over
# tensor; the rest is replicated. An array of expert slots [batch, experts, ...] thus has its batch over data and
# fsdp only.
RULES: tuple[tuple[str, Any], ...] = (
    ("experts", "expert"),
    ("batch", BATCH_AXES),
    ("batch", ("data", "fsdp")),
    ("length", "context"),
    ("embed", ("fsdp", "expert")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", None),
)


def mesh_shape(
    axes: dict[str, int], num_devices: int, name: str = "train.mesh", unit: str = "devices"
) -> tuple[int, ...]:
    """Axis sizes in MESH_AXES order, the one -1 axis filling the rest of `num_devices` (`unit` in errors)."""
    sizes = [axes.get(axis, 1) for axis in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise UserError(f"{name} {axes} does not divide the {num_devices} {unit}")
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise UserError(f"{name} {axes} needs {math.prod(sizes)} {unit} but there are {num_devices}")
    return tuple(sizes)


def granules(devices: Sequence[jax.Device]) -> tuple[str, list[list[jax.Device]]]:
    """The units joined by the data-center network: ("slice", TPU slices) on TPU, else ("process", processes)."""
    attr = "slice_index" if devices[0].platform == "tpu" else "process_index"
    groups: dict[int, list[jax.Device]] = {}
    for device in devices:
        groups.setdefault(getattr(device, attr, 0), []).append(device)
    return attr.removesuffix("_index"), [groups[k] for k in sorted(groups)]


def device_grid(axes: dict[str, int], devices: Sequence[jax.Device], dcn: dict[str, int] | None = None) -> np.ndarray:
    """The devices laid out as MESH_AXES: `dcn` sizes across slices/processes times `axes` sizes within each."""
    unit, groups = granules(devices)
    dcn_shape = (1,)
    if any(v != 1 for v in (dcn or {}).values()):
        dcn_shape = mesh_shape(dcn, len(groups), "train.dcn_mesh", {"slice": "slices", "process": "processes"}[unit])
    if math.prod(dcn_shape) == 1:
        # One mesh over all devices. Topology-aware placement on TPU slices (tensor, the most talkative
        # axis, on the closest chips); elsewhere the devices in order.
        return mesh_utils.create_device_mesh(mesh_shape(axes, len(devices)), devices, allow_split_physical_axes=True)
    if len({len(g) for g in groups}) > 1:
        raise UserError(f"train.dcn_mesh needs as many devices in each {unit}; they have {[len(g) for g in groups]}")
    ici_shape = mesh_shape(axes, len(groups[0]), "train.mesh", f"devices per {unit}")
    return mesh_utils.create_hybrid_device_mesh(
        ici_shape, dcn_shape, devices, process_is_granule=unit == "process", allow_split_physical_axes=True
    )


def make_mesh(
    axes: dict[str, int], devices: Sequence[jax.Device] | None = None, dcn: dict[str, int] | None = None
) -> Mesh:
    """A mesh over all (or the given) devices with axes data, fsdp, expert, tensor; see `device_grid` for `dcn`."""
    return Mesh(device_grid(axes, devices if devices is not None else jax.devices(), dcn), MESH_AXES)


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Trace and run under `mesh` with RULES: the model's activation constraints (nn.with_logical_constraint) apply.

    jax.set_mesh, not the legacy `with mesh:` (deprecated in jax 0.10.1), under which flax 0.12.2+ silently drops
    every logical constraint: flax reads the mesh from jax.sharding.get_abstract_mesh(), which only set_mesh sets.
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        yield mesh


def logical_shardings(boxed_tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a tree of logically partitioned values (e.g. `eval_shape` of `model.init`)."""
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_tree), mesh, RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows split over the data, fsdp and expert axes."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    """The same value on every device."""
    return NamedSharding(mesh, PartitionSpec())
