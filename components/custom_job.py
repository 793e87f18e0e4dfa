"""The train step as a Vertex AI custom job: every host runs `python -m components.train_worker`.

The launcher (the pipeline's train task) plans the step like any other, so a complete version in the
store is still a cache hit; a retried launcher follows the job its last attempt started, or starts
one that resumes from the checkpoints it left (cloud/custom_job.py). Each host learns its place from
CLUSTER_SPEC (trainer/train/distributed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cloud.custom_job import run_custom_job, worker_pool_specs
from components.steps import Step, claimed
from configs import Config, UserError
from contract.manifest import mounted_url, read_manifest

Log = Callable[[str], None]

WORKER = ["python", "-m", "components.train_worker"]


def worker_args(config_json: str, dataset: str, out: str, init: str | None, version: str) -> list[str]:
    """The command-line arguments of `components.train_worker` for one training run."""
    args = ["--config", config_json, "--dataset", dataset, "--out", out, "--version", version]
    return args + (["--init", init] if init else [])


def train_on_custom_job(
    step: Step, out: str, config_json: str, dataset: str, init: str | None, *, project: str, location: str,
    service_account: str = "", network: str = "", api_endpoint: str | None = None, credentials: Any = None,
    poll_s: float = 30.0, log: Log = print,
) -> dict[str, Any]:
    """The train step's work done by a custom job: a cache hit if `out` is complete, else launch and wait.

    The launcher holds the output's lease while the job's hosts (which run without it) train.
    """
    with claimed(step, Path(out), log) as (done, _):
        if done is not None:
            log(f"[train] cache hit: version {step.version} is complete at {out}")
            return done
        res = Config.model_validate_json(config_json).resources
        args = worker_args(config_json, dataset, out, init, step.version)
        run_custom_job(
            f"maxpipe-train-{step.version}", worker_pool_specs(res.train, res.image("train"), WORKER, args),
            project=project, location=location, base_output_dir=mounted_url(out) + "/job",
            service_account=service_account, network=network, api_endpoint=api_endpoint, credentials=credentials,
            poll_s=poll_s, log=lambda line: log(f"[train] {line}"),
        )
        manifest = read_manifest(out)
    if manifest is None or manifest["version"] != step.version:
        raise UserError(f"the training job ended but {out} holds no complete version {step.version}")
    return manifest
