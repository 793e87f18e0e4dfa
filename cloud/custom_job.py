"""A Vertex AI custom job: its worker pools, submitted (or an earlier attempt's followed), awaited, cancelled on stop.

A pipeline task is one container on one machine; work that needs several machines (GPU hosts, a
TPU slice) runs as a custom job whose worker pools start the same command on every host.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from cloud.polling import wait_for_state
from cloud.vertex_api import api_errors, one_line, vertex_session
from configs import UserError
from configs.schema import TrainResources

Log = Callable[[str], None]

_FINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"}


def worker_pool_specs(res: TrainResources, image: str, command: list[str], args: list[str]) -> list[dict[str, Any]]:
    """Vertex AI worker pools: the chief (process 0) in pool 0, the other `replicas - 1` hosts in pool 1.

    A TPU slice is one pool of one replica: Vertex provisions the slice's hosts from `tpu_topology`.
    """
    machine: dict[str, Any] = {"machine_type": res.machine_type}
    if res.accelerator_count:
        machine.update(accelerator_type=res.accelerator_type, accelerator_count=res.accelerator_count)
    if res.tpu_topology:
        machine["tpu_topology"] = res.tpu_topology
    pool = {"machine_spec": machine, "container_spec": {"image_uri": image, "command": command, "args": args}}
    specs = [{**pool, "replica_count": 1}]
    if res.replicas > 1:
        specs.append({**pool, "replica_count": res.replicas - 1})
    return specs


def run_custom_job(
    display_name: str, specs: list[dict[str, Any]], *, project: str, location: str, base_output_dir: str,
    service_account: str = "", network: str = "", api_endpoint: str | None = None, credentials: Any = None,
    poll_s: float = 30.0, log: Log = print,
) -> str:
    """Run the custom job to its end; returns its resource name, or raises a one-line UserError.

    A job of this name still running (left by an earlier attempt of the task) is awaited rather than
    doubled; if this task is stopped (SIGTERM, Ctrl-C, an error) the job is cancelled, not orphaned.
    """
    from google.cloud import aiplatform

    with vertex_session(project, location, api_endpoint, credentials, log) as creds, _sigterm_interrupts():
        where = dict(project=project, location=location, credentials=creds)
        with api_errors("cannot list Vertex AI training jobs"):
            running = [j for j in aiplatform.CustomJob.list(filter=f'display_name="{display_name}"', **where)
                       if j.state.name not in _FINAL]
        if running:
            job = running[0]
            log(f"following custom job {job.resource_name}, still running from an earlier attempt")
        else:
            job = aiplatform.CustomJob(
                display_name=display_name, worker_pool_specs=specs, base_output_dir=base_output_dir,
                staging_bucket=base_output_dir,  # required by the SDK, used only when base_output_dir is not given
                **where,
            )
            with api_errors("Vertex AI refused the training job"):
                job.submit(service_account=service_account or None, network=network or None)
            log(f"custom job {job.resource_name}: {sum(s['replica_count'] for s in specs)} hosts")
        try:
            def show(state: str) -> None:
                log(f"custom job {state.removeprefix('JOB_STATE_').lower()}")

            state = wait_for_state(lambda: job.state.name, _FINAL, show, poll_s, transient=_transient_errors())
        except BaseException:
            with contextlib.suppress(Exception):
                job.cancel()
                log(f"cancelled custom job {job.resource_name}")
            raise
        if state != "JOB_STATE_SUCCEEDED":
            error = job.gca_resource.error.message
            raise UserError(f"training job {job.resource_name} {state.removeprefix('JOB_STATE_').lower()}"
                            f"{': ' + one_line(error) if error else ''}")
    return job.resource_name


def _transient_errors() -> tuple[type[BaseException], ...]:
    """API errors a days-long wait sees now and then, retried rather than failing the task (and the job)."""
    from google.api_core import exceptions

    return (exceptions.ServiceUnavailable, exceptions.TooManyRequests, exceptions.InternalServerError,
            exceptions.GatewayTimeout, ConnectionError)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (how Vertex AI and Kubernetes stop a task) raises KeyboardInterrupt, so the job gets cancelled."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
