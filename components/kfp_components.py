"""One KFP lightweight component per step: typed artifacts in and out, the work done by `components.steps`.

KFP copies each function's source into the pipeline spec, so every import sits inside the function
and the body stays a thin call into `components.steps`, which is installed in the step's image
(and, for `kfp.local`, in the running environment). No `from __future__ import annotations` here:
KFP reads the artifact types from the real annotations.
"""


from typing import Callable, Optional

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output


def component(func: Callable, image: str) -> Callable:
    """A KFP lightweight component of one of the step functions below, to run in `image`.

    The image has maxpipe installed (infra/docker); locally kfp.local runs it in this environment.
    """
    return dsl.component(func, base_image=image, install_kfp_package=False)


def prep(config: str, dataset: Output[Dataset]):
    """Tokenize and pack the corpus into ArrayRecord shards."""
    from components.kfp_support import kfp_step
    from components import steps

    kfp_step(steps.plan_prep, config, dataset)


def ingest(config: str, hf_checkpoint: str, params: Output[Model]):
    """Convert a HF Llama safetensors checkpoint into Orbax params."""
    from components.kfp_support import kfp_step
    from components import steps

    kfp_step(lambda cfg: steps.plan_ingest(cfg, hf_checkpoint), config, params)


def train(
    config: str, dataset: Input[Dataset], checkpoints: Output[Model], metrics: Output[Metrics],
    init_params: Optional[Input[Model]] = None,
):
    """Train from random init, ingested params or the latest export; full-state checkpoints out, with the final loss,
    throughput, MFU and goodput as metrics."""
    from components.kfp_support import kfp_step, train_init, train_metrics
    from components import steps

    def plan(cfg):
        init = train_init(cfg, dataset.path, init_params.path if init_params is not None else None)
        return steps.plan_train(cfg, dataset.path, init)

    for key, value in train_metrics(kfp_step(plan, config, checkpoints)["stats"]).items():
        metrics.log_metric(key, value)


def train_job(
    config: str, project: str, location: str, service_account: str, network: str,
    dataset: Input[Dataset], checkpoints: Output[Model], metrics: Output[Metrics],
    init_params: Optional[Input[Model]] = None,
):
    """Train on several hosts (GPU machines or a TPU slice) as a Vertex AI custom job, and wait for it; metrics as
    `train`'s."""
    from components import custom_job
    from components.kfp_support import kfp_step, train_init, train_metrics
    from components import steps

    init = None

    def plan(cfg):
        nonlocal init
        init = train_init(cfg, dataset.path, init_params.path if init_params is not None else None)
        return steps.plan_train(cfg, dataset.path, init)

    def run(step, out):
        return custom_job.train_on_custom_job(
            step, out, config, dataset.path, init, project=project, location=location,
            service_account=service_account, network=network,
        )

    for key, value in train_metrics(kfp_step(plan, config, checkpoints, run)["stats"]).items():
        metrics.log_metric(key, value)


def export(config: str, checkpoints: Input[Model], dataset: Input[Dataset], model: Output[Model]):
    """Param-only Orbax checkpoint and a HF directory from the last training checkpoint."""
    from components.kfp_support import kfp_step
    from components import steps

    kfp_step(lambda cfg: steps.plan_export(cfg, checkpoints.path, dataset.path), config, model)


def evaluate(
    config: str, model: Input[Model], dataset: Input[Dataset], report: Output[Artifact], metrics: Output[Metrics],
    report_html: Output[HTML],
):
    """Validation loss, perplexity, task accuracy and samples; the report as pages the Vertex/KFP UIs show."""
    import shutil
    from pathlib import Path

    from components.kfp_support import kfp_step
    from components import steps

    manifest = kfp_step(lambda cfg: steps.plan_eval(cfg, model.path, dataset.path), config, report)
    stats = manifest["stats"]
    for key in ("val_loss", "val_perplexity", "val_tokens"):
        metrics.log_metric(key, stats[key])
    for task in stats.get("tasks", []):
        metrics.log_metric(f"{task['task']}_accuracy", task["accuracy"])
        metrics.log_metric(f"{task['task']}_accuracy_norm", task["accuracy_norm"])
    # The UIs render an HTML artifact from its own file (report.html has its plot inline), not a directory.
    if (Path(report.path) / "report.html").is_file():
        shutil.copyfile(Path(report.path) / "report.html", report_html.path)
