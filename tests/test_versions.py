"""Versions change exactly when a step's output would: its declared config fields, its inputs, the code it runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from components import steps
from configs import load_config
from contract import versions
from contract.manifest import publish

PACKAGES = ("configs", "contract", "data_prep", "trainer", "components", "cloud", "pipelines")
ROOT = Path(__file__).resolve().parents[1]

# Plans every step of the pipeline against stand-in inputs and prints each step's code and version.
PLAN_ALL = """
import json, sys
from pathlib import Path
from components import steps
from configs import load_config
from contract import versions
from contract.manifest import publish

tmp = Path(sys.argv[1])
def artifact(name, kind):
    out = tmp / name
    if not (out / "manifest.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        publish(out, kind=kind, step=name, version=name * 3, code="c", config={}, settings={}, inputs=[], stats={})
    return out
(tmp / "corpus").mkdir(parents=True, exist_ok=True)
(tmp / "corpus" / "a.py").write_text("x = 1\\n")
(tmp / "hf").mkdir(exist_ok=True)
(tmp / "hf" / "config.json").write_text("{}")
cfg = load_config("tiny", [f"data.input={tmp}/corpus/*.py"])
data, ckpt, model = artifact("data", "dataset"), artifact("ckpt", "checkpoints"), artifact("model", "exported_model")
planned = [steps.plan_prep(cfg), steps.plan_ingest(cfg, tmp / "hf"), steps.plan_train(cfg, data),
           steps.plan_export(cfg, ckpt, data), steps.plan_eval(cfg, model, data)]
print(json.dumps({"root": str(versions.ROOT), **{s.name: [s.code, s.version] for s in planned}}))
"""


def plan_all(tree: Path, scratch: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", PLAN_ALL, str(scratch)], cwd=tree, env=env, capture_output=True,
                         text=True, check=True)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result.pop("root") == str(tree)  # the copy's code was hashed, not the installed checkout's
    return result


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """Plans in an untouched copy of the code and in copies with one module edited."""
    base = tmp_path_factory.mktemp("versions")

    def copy(name: str, edit: str | None = None) -> dict:
        tree = base / name
        for package in PACKAGES:
            shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
        if edit:
            with open(tree / edit, "a") as f:
                f.write("\n# an edit\n")
        return plan_all(tree, base / "scratch")

    return {"same": copy("same"), "report": copy("report", "trainer/eval/report.py"),
            "model": copy("model", "trainer/model/decoder.py"), "checkout": plan_all(ROOT, base / "scratch")}


def changed(before: dict, after: dict) -> list[str]:
    return [name for name in before if before[name] != after[name]]


def test_an_untouched_copy_plans_the_same_versions(trees):
    assert trees["same"] == trees["checkout"]


def test_editing_the_report_reruns_eval_only(trees):
    assert changed(trees["same"], trees["report"]) == ["eval"]


def test_editing_the_model_reruns_train_export_and_eval(trees):
    assert set(changed(trees["same"], trees["model"])) >= {"train", "export", "eval"}
    assert "prep" not in changed(trees["same"], trees["model"])


@pytest.fixture
def data(tmp_path) -> Path:
    """A stand-in complete dataset for planning training against."""
    publish(tmp_path, kind="dataset", step="prep", version="d", code="c", config={}, settings={}, inputs=[], stats={})
    return tmp_path


def test_run_settings_do_not_version_training_but_its_math_does(data):
    base = steps.plan_train(load_config("tiny", []), data).version
    for setting in ("train.log_every=1", "train.tensorboard=false", "train.checkpoint_every=7",
                    "train.keep_checkpoints=5", "train.eval_every=3", "train.eval_batches=2"):
        assert steps.plan_train(load_config("tiny", [setting]), data).version == base, setting
    for change in ("train.learning_rate=1e-4", "train.seed=1", "train.steps=31", "model.emb_dim=32"):
        assert steps.plan_train(load_config("tiny", [change]), data).version != base, change


def test_a_steps_work_reads_only_what_versions_it(data):
    """Reading a run setting from the train config the work gets is an error, not a silent unversioned input."""
    step = steps.plan_train(load_config("tiny", []), data)
    train_cfg = step.work.keywords["train_cfg"]
    assert train_cfg.learning_rate > 0
    with pytest.raises(AttributeError):
        train_cfg.log_every
    assert step.work.keywords["settings"].log_every == load_config("tiny", []).train.log_every
    bound = {k for k, v in step.work.keywords.items() if isinstance(v, BaseModel)}
    assert bound == {"model_cfg", "train_cfg", "settings"}


def test_code_versions_follow_imports_not_packages():
    train = versions.modules_run("trainer.train.loop")
    assert "trainer.model.decoder" in train and "trainer.train.loss" in train
    assert not {"trainer.eval.report", "trainer.hf.export", "trainer.eval.decode", "trainer.eval.evaluate"} & set(train)
    assert "contract.records" in versions.modules_run("data_prep.prep")
    assert not any(m.startswith("configs") for m in train)  # config values are hashed, not config code
