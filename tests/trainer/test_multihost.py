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
from tests.trainer.test_train_data import random_dataset, split_train
from trainer.train.distributed import cluster_args, initialize, vertex_cluster
from trainer.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["train.steps=6", "train.batch_size=8", "train.warmup_steps=1", "train.checkpoint_every=3"]
WORKER = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from trainer.train import distributed
assert distributed.initialize(), "expected a multi-process run"
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
from configs import load_config
from tests.trainer.test_train_data import split_train
from trainer.train.loop import train
cfg = load_config("tiny", json.loads(sys.argv[3]))
train(cfg.model, *split_train(cfg.train), sys.argv[1], sys.argv[2],
      log=lambda line: print(jax.process_index(), line, flush=True))
from trainer.model.sharding import make_mesh
mesh = make_mesh(cfg.train.mesh, dcn=cfg.train.dcn_mesh)  # as train() made it: which process holds each position
print("owners", json.dumps([[[d.process_index for d in r] for r in plane] for plane in mesh.devices[:, :, 0, 0]]), flush=True)
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


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The dataset, and the per-step losses of training on it in 1 process of 8 devices."""
    tmp = tmp_path_factory.mktemp("single")
    data = random_dataset(tmp / "data", rows=48, seq_len=32, vocab=512)
    cfg = load_config("tiny", OVERRIDES)
    train(cfg.model, *split_train(cfg.train), data, tmp / "run", log=lambda _: None)
    return data, [json.loads(line)["loss"] for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "mesh, shape, owners",
    [
        # One mesh over all 8 devices, in process order: process 0 holds data 0-3, process 1 data 4-7.
        ([], "{'data': 8, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1}",
         [[[0]], [[0]], [[0]], [[0]], [[1]], [[1]], [[1]], [[1]]]),
        # data across the 2 processes (DCN), fsdp over each process's 4 devices (ICI).
        (["train.dcn_mesh={data: 2}", "train.mesh={data: 1, fsdp: -1}"],
         "{'data': 2, 'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 1}", [[[0], [0], [0], [0]], [[1], [1], [1], [1]]]),
    ],
    ids=["mesh", "dcn_mesh"],
)
def test_two_processes_train_like_one(
    tmp_path: Path, single_run: tuple[Path, list[float]], mesh: list[str], shape: str, owners: list
) -> None:
    data, single = single_run
    overrides = OVERRIDES + mesh
    coordinator = f"127.0.0.1:{_free_port()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MAXPIPE_", "CLUSTER_SPEC"))}
    base.update(PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    envs = [  # process 0 from our env vars, process 1 from a Vertex AI cluster spec
        {"MAXPIPE_COORDINATOR": coordinator, "MAXPIPE_NUM_PROCESSES": "2", "MAXPIPE_PROCESS_ID": "0"},
        {"CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": [coordinator], "workerpool1": ["127.0.0.1:1"]},
                                     "task": {"type": "workerpool1", "index": 0}})},
    ]
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(data), str(tmp_path / "multi"), json.dumps(overrides)],
                         cwd=ROOT, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for env in envs
    ]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]

    assert f"mesh {shape} over 8 devices in 2 process(es)" in outputs[0]
    assert all(f"owners {json.dumps(owners)}" in out for out in outputs)
    multi = [json.loads(line) for line in (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in multi] == list(range(1, 7))  # written once, by process 0 only
    assert len(list((tmp_path / "multi" / "tensorboard").iterdir())) == 1
    # Each process reads alternate rows of the same shuffled stream: the global batch holds the same rows in
    # another order (and the dcn mesh splits the step's sums another way), so the float32 loss sums differ in
    # order only (~1e-7 relative, grown over 6 steps).
    np.testing.assert_allclose([r["loss"] for r in multi], single, rtol=1e-5)
    saved = sorted(p.name for p in (tmp_path / "multi" / "checkpoints" / "6" / "data").glob("process_*"))
    assert saved == ["process_0-of-2.json", "process_1-of-2.json"]
