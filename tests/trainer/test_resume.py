"""Exact resume after SIGKILL (metrics and events past the checkpoint redone; an MoE model), restore onto another
mesh, and refusing a checkpoint of another model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from configs import UserError, load_config
from tests.trainer.test_metrics import tensorboard_scalars
from tests.trainer.test_train_data import random_dataset, split_train
from trainer.train import checkpoint
from trainer.train.data import shard_paths, train_iterator
from trainer.model.decoder import Transformer
from trainer.train.optimizer import make_optimizer
from trainer.model.sharding import make_mesh
from trainer.train.loop import abstract_opt_state, abstract_params, init_params, train

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["train.steps=20", "train.batch_size=8", "train.warmup_steps=2", "train.checkpoint_every=5",
             "train.log_every=1", "train.keep_checkpoints=2", "train.eval_every=10"]
# Trains like train(), but each log line takes 0.3 s, so the parent can kill it mid-run.
SLOW_RUN = """
import json, sys, time
from configs import load_config
from tests.trainer.test_train_data import split_train
from trainer.train.loop import train
cfg = load_config("tiny", json.loads(sys.argv[3]))
train(cfg.model, *split_train(cfg.train), sys.argv[1], sys.argv[2],
      log=lambda line: (print(line, flush=True), time.sleep(0.3)))
"""


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.load_balance_weight=0.01"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """overrides -> a dataset and an uninterrupted 20-step run on it, validated every 10 steps (made once each)."""
    made: dict[str, tuple[Path, Path]] = {}

    def run(overrides: list[str]) -> tuple[Path, Path]:
        key = json.dumps(overrides)
        if key not in made:
            root = tmp_path_factory.mktemp("resume")
            data = random_dataset(root / "data", rows=64, seq_len=32, vocab=512)
            cfg = load_config("tiny", overrides)
            train(cfg.model, *split_train(cfg.train), data, root / "reference", log=lambda _: None)
            rows = [json.loads(line) for line in (root / "reference" / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows if "val_loss" in r] == [10, 20]
            made[key] = data, root / "reference"
        return made[key]

    return run


@pytest.fixture(scope="module")
def reference(runs):
    return runs(OVERRIDES)


def test_sigkilled_run_resumes_to_bitwise_identical_losses(runs, tmp_path: Path) -> None:
    # An MoE model: the dense one's resume is the same code, and the router's record must come back too.
    overrides = OVERRIDES + MOE
    data, ref = runs(overrides)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_RUN, str(data), str(run), json.dumps(overrides)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while not ((run / "checkpoints" / "5").is_dir() and _rows(run) >= 8 and _last_event_step(run) > 5):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the training subprocess made no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # A checkpoint Orbax had not finished (its temporary directory) must never be resumed from.
    (run / "checkpoints" / "15.orbax-checkpoint-tmp-1").mkdir()

    cfg = load_config("tiny", overrides)
    summary = train(cfg.model, *split_train(cfg.train), data, run, log=lambda _: None)
    assert summary["resumed_from"] in (5, 10)
    # Same params, optimizer state and data position restored, same compiled program: bitwise equal on CPU.
    assert _losses(run) == _losses(ref)
    assert _column(run, "load_balance_loss") == _column(ref, "load_balance_loss")
    assert _column(run, "expert_load") == _column(ref, "expert_load")
    # TensorBoard shows each step once, as metrics.jsonl holds it: the killed run's events past the checkpoint
    # are hidden. Its last second of events may never have reached its file.
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    shown = tensorboard_scalars(run / "tensorboard")
    steps = [s for s, _ in shown["step_time"]]
    assert steps == sorted(set(steps)) and set(steps) >= set(range(summary["resumed_from"] + 1, 21))
    for tag in ("loss", "step_time"):
        assert shown[tag] == [(s, pytest.approx(rows[s][tag], rel=1e-6)) for s, _ in shown[tag]]


def _column(run: Path, key: str) -> list:
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def _rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _last_event_step(run: Path) -> int:
    return max((s for s, _ in tensorboard_scalars(run / "tensorboard").get("loss", [])), default=0)


def test_resume_onto_another_mesh(reference, tmp_path: Path) -> None:
    data, ref = reference
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "20")  # resume from step 15 ...
    cfg = load_config("tiny", OVERRIDES + ["train.mesh={fsdp: 4, tensor: 2}"])  # ... on a mesh of another shape
    model, tx = Transformer(cfg.model), make_optimizer(cfg.train)

    # The restored state holds the saved values, laid out on the new mesh.
    restored = {}
    for axes in ({"data": 8}, {"fsdp": 4, "tensor": 2}):
        mesh = make_mesh(axes)
        params = init_params(model, 32, 1, mesh)
        manager = checkpoint.train_checkpoints(run)
        it = train_iterator(shard_paths(data, "train"), 8, 0)
        param_shapes = abstract_params(model, 32, mesh)
        opt_shapes = abstract_opt_state(tx, params, mesh)
        restored[str(axes)] = checkpoint.restore_train_state(manager, 15, param_shapes, opt_shapes, it)
        manager.close()
        kernel = restored[str(axes)][0]["layers"]["mlp"]["up_proj"]["kernel"]
        assert kernel.sharding.mesh.shape == mesh.shape
    jax.tree.map(np.testing.assert_array_equal, *map(jax.device_get, restored.values()))

    summary = train(cfg.model, *split_train(cfg.train), data, run, log=lambda _: None)
    assert summary["resumed_from"] == 15
    got, want = _losses(run), _losses(ref)
    assert [s for s, _ in got] == [s for s, _ in want]
    # Steps 16-20 run on a differently sharded program: sums in another order (see test_mesh_equivalence),
    # compounded over 5 optimizer steps.
    np.testing.assert_allclose([l for _, l in got], [l for _, l in want], rtol=1e-5)


def test_checkpoint_of_another_model_is_refused_by_name(reference, tmp_path: Path) -> None:
    data, ref = reference
    shutil.copytree(ref, tmp_path / "run")
    cfg = load_config("tiny", OVERRIDES + ["train.steps=25", "model.mlp_dim=96"])
    with pytest.raises(UserError, match=r"3 parameter\(s\) differ: \['layers'\]\['mlp'\]\['down_proj'\]\['kernel'\]"):
        train(cfg.model, *split_train(cfg.train), data, tmp_path / "run", log=lambda _: None)
