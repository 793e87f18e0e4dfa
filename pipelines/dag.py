"""The pipeline DAG: prep -> [ingest] -> train -> export -> eval, built from a resolved config."""


from typing import Callable, NamedTuple

from kfp import compiler, dsl
from kfp.dsl import Artifact, Dataset, Metrics, Model

from components import kfp_components as ops
from configs import Config


class Outputs(NamedTuple):
    dataset: Dataset
    checkpoints: Model
    model: Model
    report: Artifact
    metrics: Metrics


def build_pipeline(cfg: Config) -> Callable[[], Outputs]:
    """A KFP pipeline with the config baked in; ingest runs only when a HF checkpoint is given."""
    config = cfg.model_dump_json()

    @dsl.pipeline(name=cfg.pipeline.name, description="maxpipe: tokenize, train, export and evaluate an LLM")
    def pipeline() -> Outputs:
        prep = ops.prep(config=config)
        init = {}
        if cfg.pipeline.hf_checkpoint:
            ingest = ops.ingest(config=config, hf_checkpoint=cfg.pipeline.hf_checkpoint)
            init = {"init_params": ingest.outputs["params"]}
        train = ops.train(config=config, dataset=prep.outputs["dataset"], **init)
        export = ops.export(config=config, checkpoints=train.outputs["checkpoints"], dataset=prep.outputs["dataset"])
        evaluate = ops.evaluate(config=config, model=export.outputs["model"], dataset=prep.outputs["dataset"])
        return Outputs(
            prep.outputs["dataset"], train.outputs["checkpoints"], export.outputs["model"],
            evaluate.outputs["report"], evaluate.outputs["metrics"],
        )

    return pipeline


def compile_pipeline(cfg: Config, path: str) -> None:
    """Write the pipeline spec (YAML) that Vertex AI Pipelines and Kubeflow Pipelines run."""
    compiler.Compiler().compile(build_pipeline(cfg), package_path=path)
