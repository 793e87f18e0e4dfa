"""Default XLA flags per platform (XLA_FLAGS on GPUs, LIBTPU_INIT_ARGS on TPUs), set before JAX's backend starts.

A flag the user already put in the variable keeps the user's value; MAXPIPE_XLA_FLAGS=none sets none. On CPU
nothing is set.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Collection, Mapping, MutableMapping

OFF_SWITCH = "MAXPIPE_XLA_FLAGS"
VARIABLE = {"gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

# (flag, value, why). Sources: MaxText's configs/gpu/a3/*/*.sh and benchmarks/xla_flags_library.py.
GPU_FLAGS = [
    ("xla_gpu_enable_latency_hiding_scheduler", "true", "schedule collectives to overlap compute (MaxText a3)"),
    ("xla_gpu_enable_highest_priority_async_stream", "true", "collectives first on their stream (MaxText a3)"),
    ("xla_gpu_enable_command_buffer", "", "command buffers (CUDA graphs) off, as MaxText a3 sets them"),
    ("xla_gpu_unsupported_enable_ragged_all_to_all_decomposer", "true",
     "ragged all-to-all gradients are corrupt without it (marin #8077)"),
]
# Collectives of scanned layers pipelined across loop iterations (MaxText a3). jaxlib 0.10 knows only the old
# spelling; 0.11 takes both (checked with each one's flag parser) and MaxText HEAD uses the new one.
PIPELINED = ("all_gather", "reduce_scatter", "all_reduce")
NEW_SPELLING_FROM = (0, 11)
TPU_FLAGS = [  # continuation fusion: collectives fused into the compute that follows (CF_FOR_ALL_GATHER/REDUCE)
    ("xla_tpu_enable_async_collective_fusion", "true", "MaxText CF_FOR_ALL_GATHER / CF_FOR_ALL_REDUCE"),
    ("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "true", "MaxText CF_FOR_ALL_GATHER"),
    ("xla_tpu_enable_async_collective_fusion_fuse_all_reduce", "true", "MaxText CF_FOR_ALL_REDUCE"),
    ("xla_tpu_enable_async_collective_fusion_multiple_steps", "true", "MaxText CF_FOR_ALL_GATHER / CF_FOR_ALL_REDUCE"),
    ("xla_tpu_overlap_compute_collective_tc", "true", "MaxText CF_FOR_ALL_GATHER / CF_FOR_ALL_REDUCE"),
    ("xla_enable_async_all_gather", "true", "MaxText CF_FOR_ALL_GATHER"),
    ("xla_enable_async_all_reduce", "true", "MaxText CF_FOR_ALL_REDUCE"),
    ("xla_tpu_enable_data_parallel_all_reduce_opt", "true", "DCN data-parallel all-reduce (DATA_PARALLEL_OVERLAP)"),
    ("xla_tpu_data_parallel_opt_different_sized_ops", "true", "pipeline it over iterations (DATA_PARALLEL_OVERLAP)"),
]


def jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's (major, minor, patch), read without importing it."""
    try:
        return tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:3])
    except importlib.metadata.PackageNotFoundError:
        return (0, 0, 0)


def gpu_flags(version: tuple[int, ...] | None = None) -> list[tuple[str, str, str]]:
    """The GPU table, with the pipelined-collective flags spelled as jaxlib `version` (default: installed) takes."""
    new = (version or jaxlib_version()) >= NEW_SPELLING_FROM
    why = "overlap scanned layers' collectives (MaxText a3)"
    if new:
        return GPU_FLAGS + [(f"xla_gpu_pipeline_{c}", "on", why) for c in PIPELINED]
    return GPU_FLAGS + [(f"xla_gpu_enable_pipelined_{c}", "true", why) for c in PIPELINED]


def flags(platform: str) -> list[str]:
    """`--name=value` of every default flag of `platform` ("gpu", "tpu"; none for others)."""
    table = gpu_flags() if platform == "gpu" else TPU_FLAGS if platform == "tpu" else []
    return [f"--{name}={value}" for name, value, _ in table]


def detect_platform(env: Mapping[str, str] = os.environ) -> str:
    """"gpu", "tpu" or "cpu": where JAX will run, by JAX_PLATFORMS, else the plugins and chips present (starts nothing)."""
    requested = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if requested:
        return {"cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(requested, "cpu")
    from jax._src import hardware_utils  # what JAX checks before it starts a backend

    if _installed("libtpu") and hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        return "tpu"
    if any(_installed(m) for m in CUDA_PLUGINS) and hardware_utils.has_visible_nvidia_gpu():
        return "gpu"
    return "cpu"


def apply(env: MutableMapping[str, str] = os.environ, platform: str | None = None, drop: Collection[str] = ()) -> str:
    """Add the platform's defaults (less the names in `drop`) to its variable in `env`, after the flags already
    there, which win; returns the line to log."""
    platform = platform or detect_platform(env)
    if platform not in VARIABLE:
        return f"xla flags ({platform}): none"
    var = VARIABLE[platform]
    if env.get(OFF_SWITCH, "").strip().lower() in ("none", "off", "0", "false"):
        return f"xla flags ({platform}): defaults off ({OFF_SWITCH}={env[OFF_SWITCH]}); {var}={env.get(var, '')!r}"
    present = {_name(f) for f in env.get(var, "").split()}
    added = [f for f in flags(platform) if _name(f) not in present and _name(f) not in drop]
    env[var] = " ".join([env.get(var, "")] + added).strip()
    started = added and env is os.environ and _backend_started()
    late = "; too late for this process, JAX's backend has started" if started else ""
    return f"xla flags ({platform}): {var}={env[var]!r} ({len(added)} defaults added){late}"


def rejected(candidates: list[str], platforms: str = "cpu", timeout: float = 300) -> tuple[list[str], str]:
    """Names of the flags in `candidates` that a fresh JAX process on `platforms` refuses in XLA_FLAGS, and its error.

    XLA stops at a flag it does not know or a value it cannot take: each one named is dropped and the rest tried
    again. A start that fails without naming a flag refuses them all.
    """
    refused, error = [], ""
    while True:
        kept = [f for f in candidates if _name(f) not in refused]
        env = {**os.environ, "XLA_FLAGS": " ".join(kept), "JAX_PLATFORMS": platforms, OFF_SWITCH: "none"}
        run = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                             text=True, timeout=timeout)
        if run.returncode == 0:
            return refused, error
        lines = [line for line in run.stderr.splitlines() if "flag" in line.lower()] or run.stderr.splitlines() or [""]
        error = lines[0].strip()
        named = set(re.findall(r"(?:Unknown flag in XLA_FLAGS: |for flag |Illegal value for )-*(\w+)", run.stderr))
        named -= set(refused)
        if not named:
            return refused + [_name(f) for f in kept], error
        refused += sorted(named)


def _name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # jax_plugins.* when there is no jax_plugins
        return False


def _backend_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is not None and bridge.backends_are_initialized()
