"""The device mesh and the rules that map logical axis names onto it."""

from __future__ import annotations

import math
from typing import Any

import jax
import flax.linen as nn
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import UserError

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Batch splits over data and fsdp; parameters shard their embed axis
# over fsdp and their heads/mlp/vocab axes over tensor; everything else is replicated.
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", None),
)


def mesh_shape(axes: dict[str, int], num_devices: int) -> tuple[int, ...]:
    """Axis sizes in MESH_AXES order, with the one -1 axis filling the remaining devices."""
    sizes = [axes.get(name, 1) for name in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise UserError(f"train.mesh {axes} does not divide the {num_devices} available devices")
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise UserError(f"train.mesh {axes} needs {math.prod(sizes)} devices but {num_devices} are available")
    return tuple(sizes)


def make_mesh(axes: dict[str, int], devices: list | None = None) -> Mesh:
    """A mesh over all (or the given) devices with axes data, fsdp, tensor."""
    devices = devices if devices is not None else jax.devices()
    shape = mesh_shape(axes, len(devices))
    # Topology-aware placement on TPU slices (tensor, the most talkative axis, on the closest chips);
    # elsewhere the devices in order.
    return Mesh(mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True), MESH_AXES)


def logical_shardings(boxed_tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a tree of logically partitioned values (e.g. `eval_shape` of `model.init`)."""
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_tree), mesh, RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows split over the data and fsdp axes."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
    """The same value on every device."""
    return NamedSharding(mesh, PartitionSpec())
