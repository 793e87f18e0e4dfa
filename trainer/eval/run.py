"""The eval step's work: score an exported model, then write `metrics.json` and the HTML report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from configs import EvalConfig, ModelConfig
from trainer.eval.evaluate import evaluate
from trainer.params.reader import abstract_params, load_params
from trainer.eval.report import write_report


def run_eval(
    model_dir: str | Path, out_dir: str | Path, model_cfg: ModelConfig, eval_cfg: EvalConfig, dataset_dir: str | Path,
    training_metrics: str | Path | None = None, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate the params in `model_dir` on the dataset; the report plots `training_metrics` (a metrics.jsonl) too."""
    params = load_params(model_dir, abstract_params(model_cfg))
    results = evaluate(params, model_cfg, eval_cfg, dataset_dir, log=log)
    (Path(out_dir) / "metrics.json").write_text(json.dumps(results, indent=2))
    write_report(out_dir, results, training_metrics)
    return results
