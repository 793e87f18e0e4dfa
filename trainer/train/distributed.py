"""Multi-process JAX start-up: explicit arguments, our env vars, Vertex AI's CLUSTER_SPEC, then JAX's own detection."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax

from configs import UserError


def vertex_cluster(spec_json: str) -> tuple[str, int, int]:
    """(coordinator, process count, process id) from a Vertex AI custom job's CLUSTER_SPEC.

    Processes are numbered across worker pools in pool order; the coordinator is the first host of the first pool.
    """
    try:
        spec = json.loads(spec_json)
        pools = sorted(spec["cluster"], key=lambda name: int(name.removeprefix("workerpool")))
        hosts = [host for name in pools for host in spec["cluster"][name]]
        task = spec["task"]
        process_id = sum(len(spec["cluster"][name]) for name in pools[: pools.index(task["type"])]) + int(task["index"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"CLUSTER_SPEC is not a Vertex AI cluster spec ({type(e).__name__}: {e})") from None
    return hosts[0], len(hosts), process_id


def cluster_args(
    coordinator: str = "", num_processes: int = 0, process_id: int = -1, env: Mapping[str, str] = os.environ
) -> tuple[str, int, int]:
    """(coordinator, process count, process id) from the arguments, then MAXPIPE_* env vars, then CLUSTER_SPEC.

    Each value comes from the first source that sets it; ("", 0, -1) when none names a coordinator.
    """
    coordinator = coordinator or env.get("MAXPIPE_COORDINATOR", "")
    num_processes = num_processes or int(env.get("MAXPIPE_NUM_PROCESSES") or 0)
    process_id = process_id if process_id >= 0 else int(env.get("MAXPIPE_PROCESS_ID") or -1)
    if env.get("CLUSTER_SPEC"):
        vertex = vertex_cluster(env["CLUSTER_SPEC"])
        coordinator = coordinator or vertex[0]
        num_processes = num_processes or vertex[1]
        process_id = process_id if process_id >= 0 else vertex[2]
    if coordinator and (num_processes <= 0 or not 0 <= process_id < num_processes):
        raise UserError(
            f"multi-process run with coordinator {coordinator} needs a process count and a process id below it "
            f"(got {num_processes} and {process_id}): set MAXPIPE_NUM_PROCESSES and MAXPIPE_PROCESS_ID"
        )
    return coordinator, num_processes, process_id


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> bool:
    """Join a multi-process JAX run before any JAX computation; returns True when there is more than one process.

    Explicit arguments win, then MAXPIPE_COORDINATOR / MAXPIPE_NUM_PROCESSES / MAXPIPE_PROCESS_ID, then
    Vertex AI's CLUSTER_SPEC, then JAX's auto-detection (TPU VMs, GKE, SLURM, ...). Single-process otherwise.
    """
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    coordinator, num_processes, process_id = cluster_args(coordinator, num_processes, process_id)
    if coordinator:
        if num_processes == 1:
            return False
        jax.distributed.initialize(coordinator, num_processes, process_id)
        return True
    try:
        jax.distributed.initialize()
    except ValueError as e:
        if "coordinator_address" in str(e):  # JAX detected no cluster environment: a plain single process
            return False
        raise
    except RuntimeError as e:
        if "before any JAX calls" in str(e):  # JAX already runs here (tests, notebooks): stay as it is
            return jax.process_count() > 1
        raise
    return jax.process_count() > 1
