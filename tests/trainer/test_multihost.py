"""Multi-process start-up settings, and a real 2-process run (gloo over localhost) matching 1 process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from configs import UserError, load_config
from tests.trainer.test_train_data import random_dataset
from trainer.distributed import cluster_args, initialize, vertex_cluster
from trainer.train import train

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["train.steps=6", "train.batch_size=8", "train.warmup_steps=1", "train.checkpoint_every=3"]
WORKER = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from trainer import distributed
assert distributed.initialize(), "expected a multi-process run"
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
from configs import load_config
from trainer.train import train
cfg = load_config("tiny", json.loads(sys.argv[3]))
train(cfg.model, cfg.train, sys.argv[1], sys.argv[2], log=lambda line: print(jax.process_index(), line, flush=True))
"""


def _spec(task: str, index: int) -> str:
    cluster = {"workerpool0": ["chief:2222"], "workerpool1": ["w0:2222", "w1:2222"], "workerpool2": ["r0:2222"]}
    return json.dumps({"cluster": cluster, "task": {"type": task, "index": index}})


def test_vertex_cluster_spec_numbers_processes_across_pools() -> None:
    assert vertex_cluster(_spec("workerpool0", 0)) == ("chief:2222", 4, 0)
    assert vertex_cluster(_spec("workerpool1", 1)) == ("chief:2222", 4, 2)
    assert vertex_cluster(_spec("workerpool2", 0)) == ("chief:2222", 4, 3)
    with pytest.raises(UserError, match="CLUSTER_SPEC"):
        vertex_cluster('{"cluster": {}}')


def test_arguments_win_over_env_vars_which_win_over_cluster_spec() -> None:
    env = {"MAXPIPE_COORDINATOR": "env:1", "MAXPIPE_NUM_PROCESSES": "3", "MAXPIPE_PROCESS_ID": "1",
           "CLUSTER_SPEC": _spec("workerpool1", 0)}
    assert cluster_args(env={}) == ("", 0, -1)
    assert cluster_args(env={"CLUSTER_SPEC": env["CLUSTER_SPEC"]}) == ("chief:2222", 4, 1)
    assert cluster_args(env=env) == ("env:1", 3, 1)
    assert cluster_args("arg:9", 2, 0, env=env) == ("arg:9", 2, 0)
    with pytest.raises(UserError, match="MAXPIPE_PROCESS_ID"):
        cluster_args("arg:9", env={})


def test_single_process_without_a_cluster_is_a_no_op(monkeypatch) -> None:
    for var in ("MAXPIPE_COORDINATOR", "MAXPIPE_NUM_PROCESSES", "MAXPIPE_PROCESS_ID", "CLUSTER_SPEC"):
        monkeypatch.delenv(var, raising=False)
    assert initialize() is False
    assert initialize("localhost:1", 1, 0) is False  # one process named explicitly: nothing to join


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_like_one(tmp_path: Path) -> None:
    data = random_dataset(tmp_path / "data", rows=48, seq_len=32, vocab=512)
    cfg = load_config("tiny", OVERRIDES)
    train(cfg.model, cfg.train, data, tmp_path / "single", log=lambda _: None)  # 1 process, 8 devices

    coordinator = f"127.0.0.1:{_free_port()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MAXPIPE_", "CLUSTER_SPEC"))}
    base.update(PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    envs = [  # process 0 from our env vars, process 1 from a Vertex AI cluster spec
        {"MAXPIPE_COORDINATOR": coordinator, "MAXPIPE_NUM_PROCESSES": "2", "MAXPIPE_PROCESS_ID": "0"},
        {"CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": [coordinator], "workerpool1": ["127.0.0.1:1"]},
                                     "task": {"type": "workerpool1", "index": 0}})},
    ]
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(data), str(tmp_path / "multi"), json.dumps(OVERRIDES)],
                         cwd=ROOT, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for env in envs
    ]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]

    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    single, multi = rows(tmp_path / "single"), rows(tmp_path / "multi")
    assert [r["step"] for r in multi] == list(range(1, 7))  # written once, by process 0 only
    assert len(list((tmp_path / "multi" / "tensorboard").iterdir())) == 1
    # Each process reads alternate rows of the same shuffled stream: the global batch holds the same rows in
    # another order, so the float32 loss sums differ in order only (~1e-7 relative, grown over 6 steps).
    np.testing.assert_allclose([r["loss"] for r in multi], [r["loss"] for r in single], rtol=1e-5)
    saved = sorted(p.name for p in (tmp_path / "multi" / "checkpoints" / "6" / "data").glob("process_*"))
    assert saved == ["process_0-of-2.json", "process_1-of-2.json"]
