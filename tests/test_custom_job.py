"""Multi-host training as a Vertex AI custom job: the compiled spec, the REST request, and real workers.

The launcher talks to a local stand-in of the Vertex AI REST API (tests/vertex_server.py). In the
end-to-end test the stand-in runs the job it was sent the way Vertex AI does: every replica of every
worker pool is started as a process with the pool's command and arguments and its CLUSTER_SPEC,
here two JAX CPU processes of 4 devices each that train together over gloo collectives.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.auth.credentials import AnonymousCredentials
from google.cloud.aiplatform_v1.types import AcceleratorType

from cloud.custom_job import run_custom_job, worker_pool_specs
from components import custom_job, steps
from contract import manifest as artifacts
from components.kfp_support import store_root
from configs import UserError, load_config
from pipelines.dag import LOCATION_PLACEHOLDER, PROJECT_PLACEHOLDER, compile_pipeline
from tests.helpers import small_corpus
from tests.vertex_server import FakeVertex

PROJECT, REGION = "proj", "europe-west4"
MULTIHOST = ["resources.train.replicas=2", "resources.train.machine_type=a3-highgpu-8g",
             "resources.train.accelerator_count=8", "resources.train.accelerator_type=NVIDIA_H100_80GB"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("job")
    cfg = load_config("tiny", [f"data.input=[{small_corpus(tmp / 'corpus', 150_000)}/*.py]"])
    out = tmp / "dataset"
    steps.prep(cfg, out, log=lambda _: None)
    return out


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-adc.json"))
    with FakeVertex() as server:
        yield server


def test_compiled_spec_launches_a_custom_job_with_the_runs_project(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    compile_pipeline(load_config("tiny", MULTIHOST), str(path), service_account="sa@p.iam.gserviceaccount.com")
    spec = yaml.safe_load(path.read_text())
    tasks = spec["root"]["dag"]["tasks"]
    assert "train" not in tasks and tasks["train-job"]["taskInfo"]["name"] == "train"
    params = {k: v["runtimeValue"]["constant"] for k, v in tasks["train-job"]["inputs"]["parameters"].items()}
    assert params["project"] == PROJECT_PLACEHOLDER and params["location"] == LOCATION_PLACEHOLDER
    assert params["service_account"] == "sa@p.iam.gserviceaccount.com"
    assert json.loads(params["config"])["resources"]["train"]["replicas"] == 2
    # The launcher itself needs no accelerator: the job's hosts get them.
    executor = spec["deploymentSpec"]["executors"][tasks["train-job"]["componentRef"]["name"].replace("comp-", "exec-")]
    assert "accelerator" not in json.dumps(executor["container"].get("resources", {}))


def test_single_host_and_local_runs_keep_the_plain_train_task(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    compile_pipeline(load_config("tiny"), str(path))
    assert "train" in yaml.safe_load(path.read_text())["root"]["dag"]["tasks"]


def test_worker_pools_for_gpu_hosts_and_a_tpu_slice() -> None:
    gpu = load_config("tiny", MULTIHOST).resources.train
    specs = worker_pool_specs(gpu, "img:1", custom_job.WORKER, ["--out", "o"])
    assert [s["replica_count"] for s in specs] == [1, 1]
    assert specs[0]["machine_spec"] == {"machine_type": "a3-highgpu-8g", "accelerator_type": "NVIDIA_H100_80GB",
                                        "accelerator_count": 8}
    assert specs[1]["container_spec"] == {"image_uri": "img:1", "command": custom_job.WORKER, "args": ["--out", "o"]}
    tpu = load_config("tiny", ["resources.train.machine_type=ct5lp-hightpu-4t", "resources.train.tpu_topology=4x4",
                               "resources.train.accelerator_type=TPU_V5_LITEPOD", "resources.train.accelerator_count=4"])
    specs = worker_pool_specs(tpu.resources.train, "tpu:1", custom_job.WORKER, [])
    assert len(specs) == 1 and specs[0]["machine_spec"]["tpu_topology"] == "4x4"
    with pytest.raises(ValueError, match="machine_type is needed"):
        load_config("tiny", ["resources.train.replicas=4"])


def test_launcher_sends_the_job_the_rest_api_documents_and_reports_failure(fake: FakeVertex, tmp_path: Path) -> None:
    specs = worker_pool_specs(load_config("tiny", MULTIHOST).resources.train, "img:1", custom_job.WORKER, ["--x"])
    where = dict(project=PROJECT, location=REGION, api_endpoint=fake.url, credentials=AnonymousCredentials(),
                 poll_s=0.01, log=lambda _: None)
    name = run_custom_job("maxpipe-train-v1", specs, base_output_dir="gs://b/store/train/v1/job",
                          service_account="sa@p.iam.gserviceaccount.com",
                          network="projects/1/global/networks/vpc", **where)
    (create,) = fake.calls("POST", "/customJobs$")
    assert create.path == f"/v1/projects/{PROJECT}/locations/{REGION}/customJobs"
    body = create.body
    assert body["displayName"] == "maxpipe-train-v1"
    spec = body["jobSpec"]
    assert spec["serviceAccount"] == "sa@p.iam.gserviceaccount.com"
    assert spec["network"] == "projects/1/global/networks/vpc"
    assert spec["baseOutputDirectory"]["outputUriPrefix"] == "gs://b/store/train/v1/job"
    pools = spec["workerPoolSpecs"]
    assert [int(p["replicaCount"]) for p in pools] == [1, 1]
    # The SDK's REST transport sends enums as numbers (the API takes names or numbers).
    h100 = AcceleratorType.NVIDIA_H100_80GB.value
    assert pools[0]["machineSpec"] == {"machineType": "a3-highgpu-8g", "acceleratorType": h100, "acceleratorCount": 8}
    assert pools[0]["containerSpec"] == {"imageUri": "img:1", "command": custom_job.WORKER, "args": ["--x"]}
    assert name.startswith(f"projects/{PROJECT}/locations/{REGION}/customJobs/")

    # A rerun of the task while its job still runs follows that job instead of starting a second one.
    fake.custom_jobs[name]["state"] = "JOB_STATE_RUNNING"
    states = iter(["JOB_STATE_RUNNING", "JOB_STATE_SUCCEEDED"])
    fake.run_custom_job = None

    def advance(method: str, path: str) -> None:
        if method == "GET" and path.endswith(name.rsplit("/", 1)[1]):
            fake.custom_jobs[name]["state"] = next(states, "JOB_STATE_SUCCEEDED")

    fake.on_request = advance
    assert run_custom_job("maxpipe-train-v1", specs, base_output_dir="gs://b/j", **where) == name
    assert len(fake.calls("POST", "/customJobs$")) == 1
    fake.on_request = None

    fake.run_custom_job = lambda body: "The replica workerpool1-0 exited with a non-zero status of 1."
    with pytest.raises(UserError, match=r"training job .* failed: The replica workerpool1-0 exited"):
        run_custom_job("maxpipe-train-v2", specs, base_output_dir="gs://b/j", **where)
    fake.fail("POST", "/customJobs$", 403, "PERMISSION_DENIED", "Permission 'aiplatform.customJobs.create' denied")
    with pytest.raises(UserError, match="^Vertex AI refused the training job: 403 Permission 'aiplatform.customJobs"):
        run_custom_job("maxpipe-train-v3", specs, base_output_dir="gs://b/j", **where)


def test_a_stopped_launcher_cancels_its_job(fake: FakeVertex) -> None:
    fake.run_custom_job = lambda body: time.sleep(30)  # runs until cancelled

    def stop(line: str) -> None:
        if line.endswith("running"):
            raise KeyboardInterrupt  # what SIGTERM becomes in the launcher

    specs = worker_pool_specs(load_config("tiny", MULTIHOST).resources.train, "img:1", custom_job.WORKER, [])
    with pytest.raises(KeyboardInterrupt):
        run_custom_job("maxpipe-train-v9", specs, base_output_dir="gs://b/j", project=PROJECT,
                       location=REGION, api_endpoint=fake.url, credentials=AnonymousCredentials(),
                       poll_s=0.01, log=stop)
    (cancel,) = fake.calls("POST", ":cancel$")
    assert fake.custom_jobs[cancel.path.removeprefix("/v1/").removesuffix(":cancel")]["state"] == "JOB_STATE_CANCELLED"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pools_locally(body: dict[str, Any], logs: Path) -> str | None:
    """Do what Vertex AI does with a custom job: start every replica with its CLUSTER_SPEC; wait for all."""
    pools = body["jobSpec"]["workerPoolSpecs"]
    port = _free_port()
    cluster = {f"workerpool{i}": [f"127.0.0.1:{port + j if i == 0 and j == 0 else port + 1 + j}"
                                  for j in range(int(p["replicaCount"]))] for i, p in enumerate(pools)}
    procs = []
    for i, pool in enumerate(pools):
        container = pool["containerSpec"]
        for j in range(int(pool["replicaCount"])):
            env = {**os.environ, "CLUSTER_SPEC": json.dumps({"cluster": cluster, "task": {"type": f"workerpool{i}", "index": j}}),
                   "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
                   "PYTHONPATH": str(ROOT)}
            command = [sys.executable if c == "python" else c for c in container["command"]]
            out = open(logs / f"workerpool{i}-{j}.log", "w")
            procs.append(subprocess.Popen(command + container["args"], env=env, cwd=ROOT, stdout=out,
                                          stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=600) for p in procs]
    bad = [i for i, c in enumerate(codes) if c]
    return f"replicas {bad} exited with a non-zero status" if bad else None


def test_pipeline_train_task_trains_on_two_hosts_through_a_custom_job(
    fake: FakeVertex, dataset: Path, tmp_path: Path,
) -> None:
    pytest.importorskip("trainer.train.distributed")
    logs = tmp_path / "logs"
    logs.mkdir()
    fake.run_custom_job = lambda body: run_pools_locally(body, logs)
    cfg = load_config("tiny", MULTIHOST + [f"pipeline.root={tmp_path / 'root'}", "train.steps=6",
                                           "train.checkpoint_every=3", "train.mesh={data: 2, fsdp: -1}"])
    step = steps.plan_train(cfg, dataset)
    out = str(steps.store_dir(store_root(cfg), step))
    manifest = custom_job.train_on_custom_job(
        step, out, cfg.model_dump_json(), str(dataset), None, project=PROJECT, location=REGION,
        api_endpoint=fake.url, credentials=AnonymousCredentials(), poll_s=0.2, log=lambda _: None,
    )
    worker_logs = {p.name: p.read_text() for p in logs.iterdir()}
    assert manifest["version"] == step.version, worker_logs
    assert manifest["stats"]["steps"] == 6
    assert artifacts.require_manifest(out)["version"] == step.version
    assert "mesh {'data': 2, 'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 1} over 8 devices" in worker_logs["workerpool0-0.log"]
    # The second host trained too, and left the publishing to process 0.
    assert "[process 1/2]" in worker_logs["workerpool1-0.log"]
    assert "published version" not in worker_logs["workerpool1-0.log"]
    # A rerun finds the version complete: no second job.
    again = custom_job.train_on_custom_job(
        step, out, cfg.model_dump_json(), str(dataset), None, project=PROJECT, location=REGION,
        api_endpoint=fake.url, credentials=AnonymousCredentials(), poll_s=0.2, log=lambda _: None,
    )
    assert again == manifest and len(fake.calls("POST", "/customJobs$")) == 1


def test_kubeflow_target_refuses_multihost_training_before_any_work(capsys: Any) -> None:
    from pipelines.remote_cli import remote_main

    assert remote_main(["submit", "tiny", *MULTIHOST, "--target", "kfp", "--host", "http://127.0.0.1:9"]) == 1
    assert "runs as a Vertex AI custom job: submit with --target vertex" in capsys.readouterr().err
