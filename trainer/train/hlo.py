"""What XLA made of a compiled train step: its per-device memory, and its optimized HLO written out for reading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

HLO_DIR = "hlo"


def memory_report(compiled: jax.stages.Compiled, capacity: int | None) -> dict[str, Any]:
    """Per-device bytes of the compiled program (arguments, outputs, temporaries, ...), its peak, and whether it fits."""
    memory = compiled.memory_analysis()
    sizes = {
        f"{name}_bytes": int(getattr(memory, f"{name}_size_in_bytes", 0) or 0)
        for name in ("argument", "output", "temp", "alias", "generated_code")
    }
    # What the program keeps in host memory (offloaded optimizer state and activations), apart from the device's.
    sizes["host_bytes"] = sum(
        int(getattr(memory, f"host_{name}_size_in_bytes", 0) or 0) for name in ("argument", "output", "temp")
    ) - int(getattr(memory, "host_alias_size_in_bytes", 0) or 0)
    # Donated inputs alias outputs: count those bytes once.
    peak = sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"] + sizes["temp_bytes"]
    return {**sizes, "peak_bytes_per_device": peak, "fits": None if capacity is None else peak <= capacity}


def describe_memory(report: dict[str, Any], capacity: int | None, capacity_source: str) -> str:
    """'about X GiB per device (arguments ..., outputs ..., temporaries ...): fits, N% of C GiB (source)'."""
    gib = lambda n: n / 2**30  # noqa: E731
    peak = report["peak_bytes_per_device"]
    verdict = "" if capacity is None else (
        f": fits, {peak / capacity:.0%} of {gib(capacity):.2f} GiB ({capacity_source})" if peak <= capacity else
        f": does not fit, needs {gib(peak):.2f} GiB of {gib(capacity):.2f} GiB ({capacity_source})"
    )
    return (
        f"about {gib(peak):.3f} GiB per device (arguments {gib(report['argument_bytes']):.3f}, outputs "
        f"{gib(report['output_bytes'] - report['alias_bytes']):.3f} beyond the donated arguments, temporaries "
        f"{gib(report['temp_bytes']):.3f}){verdict}"
        + (f"; {gib(report['host_bytes']):.3f} GiB in host memory" if report.get("host_bytes") else "")
    )


def dump(compiled: jax.stages.Compiled, lowered: jax.stages.Lowered, out_dir: str | Path, report: dict[str, Any]) -> Path:
    """Write the step's optimized HLO (train_step.hlo.txt), its StableHLO before XLA's passes and the memory report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_step.hlo.txt").write_text(compiled.as_text())
    (out_dir / "train_step.stablehlo.mlir").write_text(lowered.as_text())
    (out_dir / "memory.json").write_text(json.dumps(report, indent=1) + "\n")
    return out_dir
