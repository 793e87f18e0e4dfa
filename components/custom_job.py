"""Multi-host training as a Vertex AI custom job, launched and awaited by the pipeline's train task.

A pipeline task is one container on one machine. Training on several GPU machines, or on a TPU
slice, runs as a custom job whose worker pools start `python -m components.train_worker` on every
host (Vertex AI tells each one its place through CLUSTER_SPEC, see trainer/distributed.py). The
launcher plans the step like any other, so a complete version in the store is still a cache hit;
a retried launcher follows the job its last attempt started, or starts one that resumes from the
checkpoints it left.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from configs import Config, UserError
from configs.schema import TrainResources
from contract import manifest as artifacts
from components.polling import wait_for_state
from components.steps import Step
from components.vertex_api import api_errors, one_line, vertex_session

Log = Callable[[str], None]

WORKER = ["python", "-m", "components.train_worker"]
_FINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"}


def worker_pool_specs(res: TrainResources, image: str, args: list[str]) -> list[dict[str, Any]]:
    """Vertex AI worker pools: the chief (process 0) in pool 0, the other `replicas - 1` hosts in pool 1.

    A TPU slice is one pool of one replica: Vertex provisions the slice's hosts from `tpu_topology`.
    """
    machine: dict[str, Any] = {"machine_type": res.machine_type}
    if res.accelerator_count:
        machine.update(accelerator_type=res.accelerator_type, accelerator_count=res.accelerator_count)
    if res.tpu_topology:
        machine["tpu_topology"] = res.tpu_topology
    pool = {"machine_spec": machine, "container_spec": {"image_uri": image, "command": WORKER, "args": args}}
    specs = [{**pool, "replica_count": 1}]
    if res.replicas > 1:
        specs.append({**pool, "replica_count": res.replicas - 1})
    return specs


def worker_args(config_json: str, dataset: str, out: str, init: str | None, version: str) -> list[str]:
    """The command-line arguments of `components.train_worker` for one training run."""
    args = ["--config", config_json, "--dataset", dataset, "--out", out, "--version", version]
    return args + (["--init", init] if init else [])


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
            log(f"[train] following custom job {job.resource_name}, still running from an earlier attempt")
        else:
            job = aiplatform.CustomJob(
                display_name=display_name, worker_pool_specs=specs, base_output_dir=base_output_dir,
                staging_bucket=base_output_dir,  # required by the SDK, used only when base_output_dir is not given
                **where,
            )
            with api_errors("Vertex AI refused the training job"):
                job.submit(service_account=service_account or None, network=network or None)
            log(f"[train] custom job {job.resource_name}: {sum(s['replica_count'] for s in specs)} hosts")
        try:
            def show(state: str) -> None:
                log(f"[train] custom job {state.removeprefix('JOB_STATE_').lower()}")

            state = wait_for_state(lambda: job.state.name, _FINAL, show, poll_s, transient=_transient_errors())
        except BaseException:
            with contextlib.suppress(Exception):
                job.cancel()
                log(f"[train] cancelled custom job {job.resource_name}")
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


def train_on_custom_job(
    step: Step, out: str, config_json: str, dataset: str, init: str | None, *, project: str, location: str,
    service_account: str = "", network: str = "", api_endpoint: str | None = None, credentials: Any = None,
    poll_s: float = 30.0, log: Log = print,
) -> dict[str, Any]:
    """The train step's work done by a custom job: a cache hit if `out` is complete, else launch and wait."""
    cached = artifacts.prepare_output(out, step.version, keep_partial=True)
    if cached is not None:
        log(f"[train] cache hit: version {step.version} is complete at {out}")
        return cached
    res = Config.model_validate_json(config_json).resources
    args = worker_args(config_json, dataset, out, init, step.version)
    run_custom_job(
        f"maxpipe-train-{step.version}", worker_pool_specs(res.train, res.image("train"), args),
        project=project, location=location, base_output_dir=artifacts.mounted_url(out) + "/job",
        service_account=service_account, network=network, api_endpoint=api_endpoint, credentials=credentials,
        poll_s=poll_s, log=log,
    )
    manifest = artifacts.read_manifest(out)
    if manifest is None or manifest["version"] != step.version:
        raise UserError(f"the training job ended but {out} holds no complete version {step.version}")
    return manifest
