"""The pipeline DAG: prep -> [ingest] -> train -> export -> eval, built from a resolved config."""


from typing import Any, Callable, NamedTuple

from kfp import compiler, dsl
from kfp.dsl import Artifact, Dataset, Metrics, Model, PipelineTask

from components import kfp_components as ops
from configs import Config


class Outputs(NamedTuple):
    dataset: Dataset
    checkpoints: Model
    model: Model
    report: Artifact
    metrics: Metrics


# Vertex AI fills these in at run time with the run's own project and region (as in
# google-cloud-pipeline-components), so one compiled spec runs in any project.
PROJECT_PLACEHOLDER = "{{$.pipeline_google_cloud_project_id}}"
LOCATION_PLACEHOLDER = "{{$.pipeline_google_cloud_location}}"


def build_pipeline(
    cfg: Config, local: bool = False, service_account: str = "", network: str = "",
) -> Callable[[], Outputs]:
    """A KFP pipeline with the config baked in; ingest runs only when a HF checkpoint is given.

    With multi-host training configured (resources.train), the train task launches a Vertex AI
    custom job as `service_account` on `network` and waits for it, except in `local` runs.
    """
    config = cfg.model_dump_json()
    res = cfg.resources

    def train_op(**inputs: Any) -> PipelineTask:
        if local or not res.train.custom_job:
            return op("train", ops.train, **inputs)
        # The launcher only waits for the job: the hosts get resources.train's machines.
        image = res.images.get("cpu", res.image("train"))
        task = ops.component(ops.train_job, image)(
            config=config, project=PROJECT_PLACEHOLDER, location=LOCATION_PLACEHOLDER,
            service_account=service_account, network=network, **inputs,
        )
        task.set_display_name("train").set_cpu_limit("1").set_memory_limit("4G").set_caching_options(False)
        return task

    def op(name: str, func: Callable, **inputs: Any) -> PipelineTask:
        step = getattr(res, name)
        task = ops.component(func, res.image(name))(config=config, **inputs)
        task.set_display_name(name).set_cpu_limit(step.cpu).set_memory_limit(step.memory)
        # The runner's own cache keys on a task's inputs and image tag, not on the data files a run
        # fingerprints or the code inside the image: our store (components.steps) decides what to reuse.
        task.set_caching_options(False)
        if step.accelerator_count:
            task.set_accelerator_type(step.accelerator_type).set_accelerator_limit(step.accelerator_count)
        return task

    @dsl.pipeline(name=cfg.pipeline.name, description="maxpipe: tokenize, train, export and evaluate an LLM")
    def pipeline() -> Outputs:
        prep = op("prep", ops.prep)
        init = {}
        if cfg.pipeline.hf_checkpoint:
            ingest = op("ingest", ops.ingest, hf_checkpoint=cfg.pipeline.hf_checkpoint)
            init = {"init_params": ingest.outputs["params"]}
        train = train_op(dataset=prep.outputs["dataset"], **init)
        export = op("export", ops.export, checkpoints=train.outputs["checkpoints"], dataset=prep.outputs["dataset"])
        evaluate = op("eval", ops.evaluate, model=export.outputs["model"], dataset=prep.outputs["dataset"])
        return Outputs(
            prep.outputs["dataset"], train.outputs["checkpoints"], export.outputs["model"],
            evaluate.outputs["report"], evaluate.outputs["metrics"],
        )

    return pipeline


def compile_pipeline(cfg: Config, path: str, service_account: str = "", network: str = "") -> None:
    """Write the pipeline spec (YAML) that Vertex AI Pipelines and Kubeflow Pipelines run."""
    compiler.Compiler().compile(build_pipeline(cfg, False, service_account, network), package_path=path)
