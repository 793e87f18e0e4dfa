"""The whole pipeline through kfp.local on a small real corpus, checked against transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from contract.manifest import MANIFEST
from configs import load_config
from pipelines.local import run_local, summary
from pipelines.model_source import resolve_config
from trainer.train.data import shard_paths
from trainer.hf.config import model_config_from_hf, read_hf_config
from trainer.train.loss import validation_loss
from trainer.model.decoder import Transformer
from trainer.model.sharding import make_mesh
from trainer.train.loop import init_params
from tests.helpers import small_corpus, tiny_hf_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    corpus = small_corpus(tmp / "corpus")
    cfg = load_config("tiny", [f"data.input={corpus}/*.py", f"pipeline.root={tmp / 'runs'}", "train.steps=40",
                                "train.eval_every=20", "train.eval_batches=2"])
    return cfg, run_local(cfg)


def test_every_artifact_is_complete_with_a_manifest(pipeline_run):
    cfg, result = pipeline_run
    kinds = {"dataset": "dataset", "checkpoints": "checkpoints", "model": "exported_model", "report": "metrics"}
    for name, kind in kinds.items():
        manifest = json.loads((Path(result["paths"][name]) / MANIFEST).read_text())
        assert manifest["kind"] == kind and len(manifest["version"]) == 12
        assert manifest == result["manifests"][name]
    # Each step names the versions of its inputs: the lineage of the evaluation goes back to the data.
    m = result["manifests"]
    assert [i["version"] for i in m["report"]["inputs"]] == [m["model"]["version"], m["dataset"]["version"]]
    assert m["model"]["inputs"][0]["version"] == m["checkpoints"]["version"]
    assert m["checkpoints"]["inputs"][0]["version"] == m["dataset"]["version"]
    text = summary(result)
    assert "val loss" in text and m["model"]["version"] in text and "train time  goodput " in text
    # The train task's KFP metrics: its final loss, throughput and goodput totals.
    executor = json.loads((Path(result["root"]) / result["run"] / "train" / "executor_output.json").read_text())
    (train_metrics,) = executor["artifacts"]["metrics"]["artifacts"]
    assert train_metrics["metadata"]["final_loss"] == m["checkpoints"]["stats"]["final_loss"]
    assert 0 < train_metrics["metadata"]["goodput"] < 1 and train_metrics["metadata"]["goodput_attempts"] == 1


def test_eval_report_draws_the_training_curve(pipeline_run):
    cfg, result = pipeline_run
    report = Path(result["paths"]["report"])
    page = (report / "report.html").read_text()
    assert 'data-name="train"' in page and 'data-name="validation"' in page and "Evaluation report" in page
    assert "<h2>Goodput</h2>" in page  # from the training's goodput.json
    rows = [json.loads(line) for line in (Path(result["paths"]["checkpoints"]) / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    assert "loss.svg" in (report / "report.md").read_text()
    assert any((Path(result["paths"]["checkpoints"]) / "tensorboard").iterdir())


def test_training_lowers_validation_loss(pipeline_run):
    cfg, result = pipeline_run
    dataset = result["paths"]["dataset"]
    seq_len = result["manifests"]["dataset"]["stats"]["seq_len"]
    mesh = make_mesh(cfg.train.mesh)
    initial = init_params(Transformer(cfg.model), seq_len, cfg.train.seed, mesh)  # the run's step-0 params
    before = validation_loss(initial, cfg.model, shard_paths(dataset, "val"), cfg.eval.batch_size, cfg.eval.max_batches)
    after = result["manifests"]["report"]["stats"]["val_loss"]
    assert after < before["loss"] - 0.5, (before["loss"], after)


def test_exported_hf_model_matches_ours(pipeline_run):
    """transformers loads the export and gives our logits (float32; observed max abs diff ~1e-6)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, result = pipeline_run
    export = Path(result["paths"]["model"])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export / "hf", dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(export / "hf")
    ids = tokenizer("def main(argv):\n    return sorted(argv)\n" * 8)["input_ids"][:cfg.data.seq_len]

    from trainer.params.reader import abstract_params, load_params

    params = load_params(export, abstract_params(cfg.model))
    ours = np.asarray(Transformer(cfg.model).apply({"params": params}, jnp.asarray([ids], jnp.int32)))
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits.numpy()
    # Same float32 math in a different order (XLA vs torch kernels): differences stay near 1e-6;
    # 1e-4 leaves room for the platform without hiding a wrong weight (which shows up as >1e-1).
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_cli_run_reports_one_line_errors(tmp_path):
    """A missing corpus is one clear line, exit code 1, and nothing that looks complete is written."""
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "run", "tiny", f"data.input={tmp_path}/nothing/*.txt",
         f"pipeline.root={tmp_path}/runs"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "no input files match" in proc.stderr, proc.stderr
    assert not list(tmp_path.rglob(MANIFEST))


def test_pipeline_from_a_hf_checkpoint(tmp_path):
    """With pipeline.hf_checkpoint the DAG ingests it, tokenizes with its tokenizer, trains from its weights.

    No model is named, so the model config is the checkpoint's. At a learning rate of 1e-12 training
    leaves the weights as they were, so the exported model must give the original HF model's logits:
    ingest -> train -> export is checked against transformers.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    corpus = small_corpus(tmp_path / "corpus", limit_bytes=200_000)
    hf_dir = tiny_hf_llama(tmp_path / "hf", corpus)
    cfg = resolve_config(None, [  # the tiny preset's settings, without its model file
        f"data.input={corpus}/*.py", f"pipeline.root={tmp_path / 'runs'}", f"pipeline.hf_checkpoint={hf_dir}",
        "data.seq_len=64", "train.batch_size=8", "train.steps=3", "warmup_steps=0", "learning_rate=1e-12",
        "eval.batch_size=8", "eval.max_batches=4", "eval.max_new_tokens=0",
    ])
    assert cfg.model == model_config_from_hf(read_hf_config(hf_dir), name="hf")
    result = run_local(cfg)
    m = result["manifests"]
    assert all(m[name]["config"]["model"] == cfg.model.model_dump() for name in ("checkpoints", "model", "report"))
    assert m["dataset"]["stats"]["tokenizer"]["source"] == str(hf_dir)
    assert [i["kind"] for i in m["checkpoints"]["inputs"]] == ["dataset", "params"]

    ids = list(range(1, 200))
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(Path(result["paths"]["model"]) / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        before, after = (model(torch.tensor([ids])).logits.numpy() for model in (original, exported))
    np.testing.assert_allclose(after, before, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family, options", [("gpt_oss", {"mxfp4": True}), ("gemma4_moe", {"vision": True})])
def test_pipeline_from_a_2026_hub_checkpoint(family, options, tmp_path):
    """GPT-OSS as the hub stores it (MXFP4 experts) and Gemma 4 MoE (the multimodal wrapper, a vision tower that is
    skipped) run prep -> ingest -> train -> export -> eval; at a learning rate of 1e-12 the export gives
    transformers' logits of the hub checkpoint."""
    torch = pytest.importorskip("torch")
    from tests.trainer.hf_models_2026 import load_hub_format, save_hub_format, tiny_hf_model

    corpus = small_corpus(tmp_path / "corpus", limit_bytes=200_000)
    hf_dir = tiny_tokenizer(save_hub_format(tiny_hf_model(family), family, tmp_path / "hf", **options), corpus)
    cfg = resolve_config(None, [
        f"data.input={corpus}/*.py", f"pipeline.root={tmp_path / 'runs'}", f"pipeline.hf_checkpoint={hf_dir}",
        "data.seq_len=64", "train.batch_size=8", "train.steps=2", "warmup_steps=0", "learning_rate=1e-12",
        "eval.batch_size=8", "eval.max_batches=2", "eval.max_new_tokens=4",
    ])
    assert cfg.model.family == family.removesuffix("_moe")
    result = run_local(cfg)
    assert result["manifests"]["report"]["stats"]["val_perplexity"] > 1

    ids = list(range(1, 200))
    exported = load_hub_format(Path(result["paths"]["model"]) / "hf")
    with torch.no_grad():
        before, after = (model(torch.tensor([ids])).logits.numpy() for model in (load_hub_format(hf_dir), exported))
    np.testing.assert_allclose(after, before, atol=1e-4, rtol=0)
