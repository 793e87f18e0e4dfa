"""TPU slices by name (v4-8, v5e-16, v5p-64, v6e-256, ...) as devices to compile for, on any machine.

libtpu describes a slice's chips without owning them (`jax.experimental.topologies.get_topology_desc`); a
program lowered for those devices compiles ahead of time, as MaxText's train_compile does. Names and shapes
follow Google Cloud's accelerator types as MaxText maps them (its accelerator_to_spec_map.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

import jax

from configs import UserError

# Chips -> slice shape. v4 and v5p slices are 3-D tori whose names count TensorCores (2 per chip, driven as
# one "megacore" device); from 4x4x4 on, every dimension wraps around. v5e and v6e slices are 2-D and their
# names count chips; the two largest close some wraparound links.
TORUS = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8",
         1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16", 8192: "16x16x32", 12288: "16x24x32"}
GRID = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
GRID_WRAP = {128: (False, True, False), 256: (True, True, False)}
GENERATIONS = {  # name prefix -> (libtpu topology prefix, TensorCores the name counts per chip)
    "v4": ("v4", 2), "v5p": ("v5", 2), "v5e": ("v5e", 1), "v5litepod": ("v5e", 1), "v6e": ("v6e", 1),
}


@dataclass(frozen=True)
class Slice:
    """One TPU slice as libtpu's topology description takes it."""

    topology: str  # e.g. v5:2x4x4
    chip_config: str  # megacore | default
    chips_per_host: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]


def parse_slice(name: str) -> Slice:
    """The slice a Cloud TPU accelerator type names, e.g. v5p-64 (32 chips, 2x4x4) or v6e-256 (16x16)."""
    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip().lower())
    if not match:
        raise UserError(f"unknown TPU slice {name!r}: give a Cloud TPU type such as v4-8, v5e-16, v5p-64 or v6e-256")
    prefix, cores_per_chip = GENERATIONS[match[1]]
    chips = int(match[2]) // cores_per_chip
    shapes = TORUS if cores_per_chip == 2 else GRID
    if int(match[2]) % cores_per_chip or chips not in shapes:
        sizes = ", ".join(f"{match[1]}-{n * cores_per_chip}" for n in list(shapes)[:6])
        raise UserError(f"no TPU slice {name!r}: {match[1]} slices are {sizes}, ...")
    if cores_per_chip == 2:
        return Slice(f"{prefix}:{shapes[chips]}", "megacore", (2, 2, 1), (chips >= 64,) * 3)
    hosts = (1, 1, 1) if chips == 1 else (2, 2, 1)
    return Slice(f"{prefix}:{shapes[chips]}", "default", hosts, GRID_WRAP.get(chips, (False,) * 3))


def slice_devices(name: str, num_slices: int = 1) -> list[jax.Device]:
    """The devices of `num_slices` slices of type `name`, described by libtpu (no TPU needed) for compiling."""
    spec = parse_slice(name)
    if importlib.util.find_spec("libtpu") is None:
        raise UserError("compiling for a TPU slice needs libtpu: pip install -e '.[tpu]'")
    # Off a TPU VM libtpu cannot read the host's TPU metadata: tell it there are none to find (else it logs
    # errors), and let a second process load it beside this one.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", name)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=spec.topology, chip_config_name=spec.chip_config,
        chips_per_host_bounds=spec.chips_per_host, num_slices=num_slices, wrap=spec.wrap,
    )
    return list(topology.devices)
