"""The accelerator chips maxpipe knows: peak dense bf16 FLOP/s (for MFU) and memory per chip (for fit checks)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One accelerator chip as the vendor specifies it."""

    name: str
    peak_flops: float  # dense bfloat16 FLOP/s
    memory_bytes: int  # HBM a program may use
    kinds: tuple[str, ...]  # words of jax's `device_kind` naming it, lower case


# Vendor figures; TPU memory as XLA:TPU offers it to a program (the spec's 32, 16, 95 and 32 GB less what
# the runtime keeps). More specific names first: "tpu v5 lite" (v5e) before "tpu v5" (v5p).
CHIPS = (
    Chip("H200", 989e12, 141 * 10**9, ("h200",)),
    Chip("H100", 989e12, 80 * 10**9, ("h100",)),
    Chip("A100 40GB", 312e12, 40 * 10**9, ("a100-sxm4-40gb", "a100-pcie-40gb")),
    Chip("A100", 312e12, 80 * 10**9, ("a100",)),
    Chip("L4", 121e12, 24 * 10**9, ("l4",)),
    Chip("A10", 125e12, 24 * 10**9, ("a10",)),
    Chip("TPU v6e", 918e12, int(31.25 * GiB), ("tpu v6 lite", "tpu v6e")),
    Chip("TPU v5e", 197e12, int(15.75 * GiB), ("tpu v5 lite", "tpu v5e")),
    Chip("TPU v5p", 459e12, int(95.74 * GiB), ("tpu v5p", "tpu v5")),
    Chip("TPU v4", 275e12, int(30.75 * GiB), ("tpu v4",)),
)


def chip_of(device: jax.Device) -> Chip | None:
    """The chip a device is, by its `device_kind`; None for CPUs and chips not in CHIPS."""
    kind = device.device_kind.lower()
    named = lambda k: re.search(rf"\b{re.escape(k)}\b", kind)  # noqa: E731 - "l4" is not "l40s", "a10" not "a100"
    return next((chip for chip in CHIPS if any(named(k) for k in chip.kinds)), None)


def memory_of(device: jax.Device) -> tuple[int | None, str]:
    """Memory one device has for a program, and where the figure comes from; None where unknown (CPU)."""
    try:  # devices of a described TPU slice (topology.py) have no stats
        stats = device.memory_stats() if device.platform != "cpu" else None
    except jax.errors.JaxRuntimeError:
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "the runtime's limit"
    chip = chip_of(device)
    return (chip.memory_bytes, f"{chip.name} HBM") if chip else (None, "unknown")
