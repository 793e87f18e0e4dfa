"""Versioned outputs on real kfp.local runs: what reruns when nothing, a setting, or the data changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from contract.manifest import MANIFEST
from configs import load_config
from pipelines.local import run_local
from tests.helpers import small_corpus

STEPS = ("dataset", "checkpoints", "model", "report")


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    corpus = small_corpus(tmp / "corpus", limit_bytes=150_000)
    overrides = [f"data.input={corpus}/*.py", f"pipeline.root={tmp / 'runs'}", "train.steps=6", "eval.max_new_tokens=4"]
    return corpus, overrides, run_local(load_config("tiny", overrides))


def versions(result: dict) -> dict[str, str]:
    return {name: result["manifests"][name]["version"] for name in STEPS}


def test_nothing_changed_reuses_every_step(first):
    _, overrides, before = first
    after = run_local(load_config("tiny", overrides))
    for name in STEPS:  # same directories, and their manifests were not written again
        assert after["paths"][name] == before["paths"][name]
        assert after["manifests"][name] == before["manifests"][name]
    assert "/store/prep/" in before["paths"]["dataset"]


def test_a_training_setting_reruns_train_export_and_eval_only(first):
    _, overrides, before = first
    after = run_local(load_config("tiny", [*overrides, "train.learning_rate=1e-3"]))
    old, new = versions(before), versions(after)
    assert new["dataset"] == old["dataset"]
    assert all(new[name] != old[name] for name in ("checkpoints", "model", "report"))


def test_an_eval_setting_reruns_eval_only(first):
    _, overrides, before = first
    after = run_local(load_config("tiny", [*overrides, "eval.prompt=class "]))
    old, new = versions(before), versions(after)
    assert [name for name in STEPS if new[name] != old[name]] == ["report"]


def test_added_data_reruns_everything(first, tmp_path):
    corpus, overrides, before = first
    grown = tmp_path / "grown"
    shutil.copytree(corpus, grown)
    (grown / "new_module.py").write_text("def added():\n    return 'new data'\n" * 50)
    after = run_local(load_config("tiny", [*overrides, f"data.input={grown}/*.py"]))
    old, new = versions(before), versions(after)
    assert all(new[name] != old[name] for name in STEPS)
    assert after["manifests"]["dataset"]["stats"]["documents"] != before["manifests"]["dataset"]["stats"]["documents"]


def test_a_crashed_step_is_redone_not_reused(first):
    _, overrides, before = first
    report = Path(before["paths"]["report"])
    (report / MANIFEST).unlink()  # as if eval died before publishing
    (report / "metrics.json").write_text("half-written")
    after = run_local(load_config("tiny", overrides))
    assert after["paths"]["report"] == str(report)
    assert after["manifests"]["report"]["version"] == before["manifests"]["report"]["version"]
    assert after["manifests"]["report"]["created"] >= before["manifests"]["report"]["created"]
    assert (report / "metrics.json").read_text() != "half-written"
    assert after["manifests"]["checkpoints"] == before["manifests"]["checkpoints"]


def test_scheduled_retraining_continues_from_the_last_model_only_on_new_data(first, tmp_path):
    """With train.continue_from=latest_export: unchanged data is a cache hit, new data trains on from the last export."""
    corpus, overrides, _ = first
    retrain = [*overrides, f"pipeline.root={tmp_path / 'runs'}", "train.continue_from=latest_export"]
    one = run_local(load_config("tiny", retrain))
    assert [i["kind"] for i in one["manifests"]["checkpoints"]["inputs"]] == ["dataset"]  # nothing to continue from
    assert run_local(load_config("tiny", retrain))["manifests"] == one["manifests"]  # the weekly run, no new data

    grown = tmp_path / "grown"
    shutil.copytree(corpus, grown)
    (grown / "fresh.py").write_text("def fresh():\n    return 'this week'\n" * 40)
    two = run_local(load_config("tiny", [*retrain, f"data.input={grown}/*.py"]))
    start = two["manifests"]["checkpoints"]["inputs"][1]
    assert (start["kind"], start["version"]) == ("exported_model", one["manifests"]["model"]["version"])
    assert run_local(load_config("tiny", [*retrain, f"data.input={grown}/*.py"]))["manifests"] == two["manifests"]
