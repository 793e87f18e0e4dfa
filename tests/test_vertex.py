"""Submission and schedules against local stand-ins for the Vertex AI REST API and the KFP API.

The real SDKs (google-cloud-aiplatform over its REST transport, kfp.Client) talk HTTP to fake
servers on 127.0.0.1 (tests/vertex_server.py) that record each request; the tests check the
requests carry what the REST APIs document, and that error answers become one clear line.
Nothing here reaches Google: ADC is pointed at a missing file, Cloud Storage at the fake server.
"""


import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.auth.credentials import AnonymousCredentials

from configs import UserError, load_config
from pipelines import kfp_target, vertex
from pipelines.cron import normalize_cron
from pipelines.dag import compile_pipeline
from pipelines.remote_cli import remote_main
from tests.vertex_server import FakeKFP, FakeVertex

PROJECT, REGION, ROOT = "proj", "europe-west4", "gs://bkt/runs"
PARENT = f"/v1/projects/{PROJECT}/locations/{REGION}"
SA = "runner@proj.iam.gserviceaccount.com"
NETWORK = "projects/123/global/networks/vpc"


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("spec") / "pipeline.yaml"
    compile_pipeline(load_config("tiny"), str(path))
    return str(path)


@pytest.fixture(autouse=True)
def no_google(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Whatever the SDK resolves by itself (ADC for its bucket-ownership check) fails fast, offline."""
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-adc.json"))
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    monkeypatch.delenv("GOOGLE_CLOUD_REGION", raising=False)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    with FakeVertex() as server:
        # PipelineJob.submit checks the pipeline root's bucket with the Cloud Storage client.
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        yield server


@pytest.fixture
def kfp_fake() -> Any:
    with FakeKFP() as server:
        yield server


def where(fake: FakeVertex) -> dict[str, Any]:
    return {"project": PROJECT, "region": REGION, "api_endpoint": fake.url, "credentials": AnonymousCredentials()}


def tasks(pipeline_spec: dict[str, Any]) -> dict[str, Any]:
    return pipeline_spec["root"]["dag"]["tasks"]


# ------------------------------------------------------------------------------------- submit


def test_submit_sends_the_pipeline_job_the_rest_api_documents(fake: FakeVertex, spec: str) -> None:
    lines: list[str] = []
    info = vertex.submit(spec, pipeline_root=ROOT, display_name="nightly", service_account=SA, network=NETWORK,
                         labels={"team": "ml"}, enable_caching=False, log=lines.append, **where(fake))

    (create,) = fake.calls("POST", "/pipelineJobs$")
    assert create.path == f"{PARENT}/pipelineJobs"
    job_id = create.query["pipelineJobId"]
    assert re.fullmatch(r"nightly-\d{8}-\d{6}-[0-9a-f]{4}", job_id)
    body = create.body
    compiled = yaml.safe_load(Path(spec).read_text())
    assert body["displayName"] == "nightly"
    assert body["runtimeConfig"] == {"gcsOutputDirectory": ROOT}  # the tiny pipeline has no parameters
    assert body["serviceAccount"] == SA and body["network"] == NETWORK and body["labels"] == {"team": "ml"}
    # The template travels inline: the compiled spec, with caching forced off on every task.
    assert body["pipelineSpec"]["deploymentSpec"] == compiled["deploymentSpec"]
    assert body["pipelineSpec"]["components"] == compiled["components"]
    assert set(tasks(body["pipelineSpec"])) == set(tasks(compiled)) == {"prep", "train", "export", "evaluate"}
    assert all(t["cachingOptions"] == {"enableCache": False} for t in tasks(body["pipelineSpec"]).values())

    name = f"projects/{PROJECT}/locations/{REGION}/pipelineJobs/{job_id}"
    console = f"https://console.cloud.google.com/vertex-ai/locations/{REGION}/pipelines/runs/{job_id}?project={PROJECT}"
    assert info == {"name": name, "job_id": job_id, "console_url": console, "state": "PIPELINE_STATE_PENDING"}
    assert f"console: {console}" in lines
    assert fake.calls("GET", "^/storage/v1/b/bkt$")  # the SDK's bucket check went to the stand-in too


def test_submit_keeps_compile_time_caching_and_sends_parameters(fake: FakeVertex, tmp_path: Path) -> None:
    from kfp import compiler, dsl

    @dsl.component(base_image="python:3.11")
    def echo(text: str, times: int) -> str:
        return text * times

    @dsl.pipeline(name="with-params")
    def with_params(text: str = "a", times: int = 1) -> None:
        echo(text=text, times=times).set_caching_options(False)

    path = str(tmp_path / "params.yaml")
    compiler.Compiler().compile(with_params, package_path=path)
    vertex.submit(path, pipeline_root=ROOT, display_name="p", parameter_values={"text": "hi", "times": 3},
                  log=lambda _: None, **where(fake))
    body = fake.calls("POST", "/pipelineJobs$")[0].body
    assert body["runtimeConfig"] == {"gcsOutputDirectory": ROOT, "parameterValues": {"text": "hi", "times": 3}}
    assert tasks(body["pipelineSpec"])["echo"]["cachingOptions"] == {}  # compiled off (proto default), untouched
    assert "serviceAccount" not in body and "network" not in body and "labels" not in body

    with pytest.raises(UserError, match="cannot prepare the Vertex AI pipeline run: .*typo"):
        vertex.submit(path, pipeline_root=ROOT, display_name="p", parameter_values={"typo": 1}, **where(fake))


def test_wait_follows_the_run_until_it_ends(fake: FakeVertex, spec: str) -> None:
    fake.job_states = ["PIPELINE_STATE_RUNNING", "PIPELINE_STATE_RUNNING", "PIPELINE_STATE_SUCCEEDED"]
    lines: list[str] = []
    info = vertex.submit(spec, pipeline_root=ROOT, display_name="w", wait=True, poll_s=0, log=lines.append,
                         **where(fake))
    assert info["state"] == "PIPELINE_STATE_SUCCEEDED"
    assert [line.split(": ")[-1] for line in lines[-2:]] == ["running", "succeeded"]
    assert len(fake.calls("GET", f"{PARENT}/pipelineJobs/")) == 3

    fake.job_states = ["PIPELINE_STATE_FAILED"]
    fake.job_error = {"code": 9, "message": "The replica workerpool0-0 exited with a non-zero status of 1."}
    with pytest.raises(UserError) as err:
        vertex.submit(spec, pipeline_root=ROOT, display_name="w", wait=True, poll_s=0, log=lambda _: None,
                      **where(fake))
    assert "failed: The replica workerpool0-0 exited with a non-zero status of 1." in str(err.value)
    assert "https://console.cloud.google.com/vertex-ai/" in str(err.value)


# ---------------------------------------------------------------------------------- schedules


def test_schedule_create_sends_cron_concurrency_and_the_run_request(fake: FakeVertex, spec: str) -> None:
    info = vertex.schedule_create(spec, pipeline_root=ROOT, display_name="weekly", cron="TZ=Europe/Paris 0 3 * * 1",
                                  max_concurrent_runs=2, service_account=SA, network=NETWORK,
                                  labels={"team": "ml"}, enable_caching=False, log=lambda _: None, **where(fake))
    (create,) = fake.calls("POST", "/schedules$")
    body = create.body
    assert create.path == f"{PARENT}/schedules"
    assert body["displayName"] == "weekly"
    assert body["cron"] == "TZ=Europe/Paris 0 3 * * 1"
    assert body["maxConcurrentRunCount"] == "2"  # int64: a JSON string in proto3 JSON
    request = body["createPipelineJobRequest"]
    assert request["parent"] == f"projects/{PROJECT}/locations/{REGION}"
    job = request["pipelineJob"]
    assert job["runtimeConfig"] == {"gcsOutputDirectory": ROOT}
    assert job["serviceAccount"] == SA and job["network"] == NETWORK and job["labels"] == {"team": "ml"}
    assert all(t["cachingOptions"] == {"enableCache": False} for t in tasks(job["pipelineSpec"]).values())
    assert info["state"] == "ACTIVE" and info["cron"] == "TZ=Europe/Paris 0 3 * * 1"
    assert info["next_run"].startswith("2026-11-23T02:00:00")
    assert info["console_url"].endswith(f"/pipelines/schedules/{info['name'].rsplit('/', 1)[-1]}?project={PROJECT}")
    assert not fake.calls(path_re="pipelineJobs")  # a schedule starts no run by itself

    with pytest.raises(UserError, match="a schedule named 'weekly' already exists"):
        vertex.schedule_create(spec, pipeline_root=ROOT, display_name="weekly", cron="0 3 * * 1", **where(fake))


def test_schedule_list_pause_resume_delete_hit_their_paths(fake: FakeVertex, spec: str) -> None:
    quiet = {"log": lambda _: None, **where(fake)}
    weekly = vertex.schedule_create(spec, pipeline_root=ROOT, display_name="weekly", cron="0 3 * * 1", **quiet)
    daily = vertex.schedule_create(spec, pipeline_root=ROOT, display_name="daily", cron="CRON_TZ=UTC 0 1 * * *",
                                   **quiet)
    rows = vertex.schedule_list(**where(fake))
    assert [(r["display_name"], r["cron"], r["state"]) for r in rows] == [
        ("weekly", "0 3 * * 1", "ACTIVE"), ("daily", "TZ=UTC 0 1 * * *", "ACTIVE")]
    assert all(r["next_run"] for r in rows)

    assert vertex.schedule_pause("weekly", **quiet)["state"] == "PAUSED"  # by display name
    assert fake.calls("POST")[-1].path == f"/v1/{weekly['name']}:pause"
    assert vertex.schedule_resume(weekly["name"], **quiet)["state"] == "ACTIVE"  # by resource name
    assert fake.calls("POST")[-1].path == f"/v1/{weekly['name']}:resume"
    daily_id = daily["name"].rsplit("/", 1)[-1]
    assert vertex.schedule_delete(daily_id, **quiet)["state"] == "DELETED"  # by id
    assert fake.calls("DELETE")[-1].path == f"/v1/{daily['name']}"
    assert [r["display_name"] for r in vertex.schedule_list(**where(fake))] == ["weekly"]


def test_schedule_names_that_match_nothing_or_several(fake: FakeVertex, spec: str) -> None:
    with pytest.raises(UserError, match="no schedule named 'nope' in project proj, region europe-west4"):
        vertex.schedule_pause("nope", **where(fake))
    with pytest.raises(UserError) as err:
        vertex.schedule_delete(f"projects/{PROJECT}/locations/{REGION}/schedules/999", **where(fake))
    assert str(err.value) == (f"cannot find schedule 'projects/{PROJECT}/locations/{REGION}/schedules/999': "
                              f"404 Schedule projects/{PROJECT}/locations/{REGION}/schedules/999 not found")
    for sid in ("1", "2"):  # two schedules with one display name, made elsewhere
        name = f"projects/{PROJECT}/locations/{REGION}/schedules/{sid}"
        fake.schedules[name] = {"name": name, "displayName": "dup", "cron": "0 0 * * *", "state": "ACTIVE"}
    with pytest.raises(UserError, match="2 schedules are named 'dup'; name one by its resource name"):
        vertex.schedule_resume("dup", **where(fake))


@pytest.mark.parametrize("cron, expected", [
    ("0 3 * * 1", "0 3 * * 1"),
    ("  TZ=Europe/Paris   0 3 * * 1 ", "TZ=Europe/Paris 0 3 * * 1"),
    ("CRON_TZ=America/New_York 30 2 1 * *", "TZ=America/New_York 30 2 1 * *"),
    ("0 3 * *", "expected 5 fields"),
    ("0 0 3 * * 1", "expected 5 fields"),
    ("TZ=Mars/Olympus 0 3 * * 1", "unknown time zone 'Mars/Olympus'"),
])
def test_cron_is_checked_before_any_request(cron: str, expected: str) -> None:
    if "expected" in expected or "unknown" in expected:
        with pytest.raises(UserError, match=expected):
            normalize_cron(cron)
    else:
        assert normalize_cron(cron) == expected


# -------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("method, path, code, status, message, call, expected", [
    ("POST", "/pipelineJobs$", 403, "PERMISSION_DENIED",
     f"Permission 'aiplatform.pipelineJobs.create' denied on resource '//aiplatform.googleapis.com/projects/{PROJECT}"
     f"/locations/{REGION}' (or it may not exist).", "submit", "Vertex AI refused the pipeline run: 403 Permission"),
    ("POST", "/schedules$", 400, "INVALID_ARGUMENT", "Invalid cron expression: 61 3 * * 1.",
     "schedule_create", "Vertex AI refused the schedule 'nightly': 400 Invalid cron expression"),
    ("GET", "/schedules$", 403, "PERMISSION_DENIED", "Permission 'aiplatform.schedules.list' denied on project.",
     "schedule_list", f"cannot list the schedules of project {PROJECT} in {REGION}: 403 Permission"),
    ("POST", ":pause$", 400, "FAILED_PRECONDITION", "Schedule is already paused.",
     "schedule_pause", "Vertex AI refused to pause schedule 'nightly': 400 Schedule is already paused."),
])
def test_api_errors_become_one_line(fake: FakeVertex, spec: str, method: str, path: str, code: int, status: str,
                                    message: str, call: str, expected: str) -> None:
    if call == "schedule_pause":
        vertex.schedule_create(spec, pipeline_root=ROOT, display_name="nightly", cron="0 1 * * *",
                               log=lambda _: None, **where(fake))
    fake.fail(method, path, code, status, message)
    run = {
        "submit": lambda: vertex.submit(spec, pipeline_root=ROOT, display_name="nightly", **where(fake)),
        "schedule_create": lambda: vertex.schedule_create(spec, pipeline_root=ROOT, display_name="nightly",
                                                          cron="0 1 * * *", **where(fake)),
        "schedule_list": lambda: vertex.schedule_list(**where(fake)),
        "schedule_pause": lambda: vertex.schedule_pause("nightly", **where(fake)),
    }[call]
    with pytest.raises(UserError) as err:
        run()
    text = str(err.value)
    assert text.startswith(expected) and text.endswith(message) and "\n" not in text


def test_missing_credentials_say_how_to_log_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, spec: str) -> None:
    # No key file, an empty gcloud config and not on GCE: Application Default Credentials are absent.
    from google.auth.compute_engine import _metadata

    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setattr(_metadata, "_NO_GCE_CHECK", True)  # google-auth reads NO_GCE_CHECK=true at import
    with pytest.raises(UserError) as err:
        vertex.submit(spec, project=PROJECT, region=REGION, pipeline_root=ROOT, display_name="x")
    assert str(err.value).startswith("no Google Cloud credentials found: run `gcloud auth application-default login`")


def test_unreachable_endpoint_and_bad_input(fake: FakeVertex, spec: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = {"project": PROJECT, "region": REGION, "api_endpoint": f"http://127.0.0.1:{port}"}
    with pytest.raises(UserError, match=rf"cannot list the schedules .*: cannot reach http://127.0.0.1:{port}/v1/"):
        vertex.schedule_list(**endpoint)
    with pytest.raises(UserError, match="--pipeline-root must be a gs:// URI"):
        vertex.submit(spec, pipeline_root="/tmp/runs", display_name="x", **endpoint)
    with pytest.raises(UserError, match="pipeline spec not found"):
        vertex.submit("/nonexistent.yaml", pipeline_root=ROOT, display_name="x", **endpoint)
    with pytest.raises(UserError, match="label key 'Team': use 1-63 lowercase letters"):
        vertex.submit(spec, pipeline_root=ROOT, display_name="x", labels={"Team": "ml"}, **endpoint)
    with pytest.raises(UserError, match="unknown Vertex AI region 'mars-central1'"):
        vertex.submit(spec, pipeline_root=ROOT, display_name="x", **{**endpoint, "region": "mars-central1"})
    assert not fake.calls(path_re="^/v1/")  # none of these reached the API


# ------------------------------------------------------------------------------------ the CLI


def test_cli_submit_compiles_the_preset_and_prints_the_console_link(fake: FakeVertex, capsys: Any) -> None:
    code = remote_main([
        "submit", "tiny", "train.steps=7", "--project", PROJECT, "--region", REGION, "--pipeline-root", ROOT,
        "--labels", "team=ml,env=dev", "--no-cache", "--service-account", SA, "--api-endpoint", fake.url])
    out, err = capsys.readouterr()
    assert code == 0, err
    job_id = fake.calls("POST", "/pipelineJobs$")[0].query["pipelineJobId"]
    assert (f"console: https://console.cloud.google.com/vertex-ai/locations/{REGION}/pipelines/runs/{job_id}"
            f"?project={PROJECT}") in out
    body = fake.calls("POST", "/pipelineJobs$")[0].body
    assert body["labels"] == {"team": "ml", "env": "dev"} and body["serviceAccount"] == SA
    assert all(t["cachingOptions"] == {"enableCache": False} for t in tasks(body["pipelineSpec"]).values())
    config = json.loads(tasks(body["pipelineSpec"])["train"]["inputs"]["parameters"]["config"]["runtimeValue"]["constant"])
    assert config["train"]["steps"] == 7
    assert config["pipeline"]["root"] == ROOT  # the steps write under the run's pipeline root


def test_cli_schedules_and_error_lines(fake: FakeVertex, capsys: Any) -> None:
    base = ["--project", PROJECT, "--region", REGION, "--api-endpoint", fake.url]
    assert remote_main(["schedule", "create", "tiny", "--cron", "TZ=Europe/Paris 0 3 * * 1",
                               "--display-name", "weekly", "--pipeline-root", ROOT, *base]) == 0
    assert fake.calls("POST", "/schedules$")[0].body["cron"] == "TZ=Europe/Paris 0 3 * * 1"
    assert remote_main(["schedule", "list", *base]) == 0
    out = capsys.readouterr().out
    assert "created schedule 'weekly'" in out
    header, row = out.strip().splitlines()[-2:]
    assert header.split() == ["DISPLAY_NAME", "STATE", "CRON", "NEXT_RUN", "NAME"]
    assert row.startswith("weekly") and "ACTIVE" in row and "TZ=Europe/Paris 0 3 * * 1" in row
    assert remote_main(["schedule", "pause", "weekly", *base]) == 0
    assert "paused schedule 'weekly'" in capsys.readouterr().out

    fake.fail("POST", "/pipelineJobs$", 403, "PERMISSION_DENIED", "Permission 'aiplatform.pipelineJobs.create' denied")
    assert remote_main(["submit", "tiny", "--pipeline-root", ROOT, *base]) == 1
    err = capsys.readouterr().err
    assert err == ("error: Vertex AI refused the pipeline run: 403 Permission 'aiplatform.pipelineJobs.create' "
                   "denied\n")
    assert remote_main(["submit", "tiny", *base]) == 1
    assert capsys.readouterr().err.startswith("error: Vertex AI needs --pipeline-root gs://")
    assert remote_main(["schedule", "resume", "nope", *base]) == 1
    assert capsys.readouterr().err.startswith("error: no schedule named 'nope'")
    with pytest.raises(UserError):
        remote_main(["schedule", "resume", "nope", "--debug", *base])


# ------------------------------------------------------------------------- Kubeflow Pipelines


def test_kfp_submit_and_recurring_runs(kfp_fake: FakeKFP, spec: str) -> None:
    lines: list[str] = []
    info = kfp_target.kfp_submit(spec, host=kfp_fake.url, run_name="nightly", experiment="maxpipe",
                                 pipeline_root="gs://bkt/kfp", enable_caching=False, log=lines.append)
    (run,) = kfp_fake.calls("POST", "/apis/v2beta1/runs$")
    (experiment,) = kfp_fake.calls("POST", "/apis/v2beta1/experiments$")
    assert experiment.body["display_name"] == "maxpipe"
    assert run.body["display_name"] == "nightly"
    assert run.body["experiment_id"] == next(iter(kfp_fake.experiments))
    assert run.body["runtime_config"] == {"pipeline_root": "gs://bkt/kfp", "parameters": {}}
    compiled = yaml.safe_load(Path(spec).read_text())
    assert run.body["pipeline_spec"]["deploymentSpec"] == compiled["deploymentSpec"]
    assert all(t.get("cachingOptions", {}).get("enableCache", False) is False
               for t in tasks(run.body["pipeline_spec"]).values())
    assert info["url"] == f"{kfp_fake.url}/#/runs/details/{info['name']}"
    assert f"console: {info['url']}" in lines

    quiet = {"host": kfp_fake.url, "log": lambda _: None}
    weekly = kfp_target.kfp_schedule_create(spec, display_name="weekly", cron="TZ=Europe/Paris 0 3 * * 1",
                                            max_concurrent_runs=2, **quiet)
    body = kfp_fake.calls("POST", "/recurringruns$")[0].body
    assert body["trigger"] == {"cron_schedule": {"cron": "TZ=Europe/Paris 0 0 3 * * 1"}}  # KFP: seconds first
    assert body["max_concurrency"] == 2 and body["mode"] == "ENABLE" and body["no_catchup"] is True
    assert body["pipeline_spec"]["deploymentSpec"] == compiled["deploymentSpec"]
    assert [r["display_name"] for r in kfp_target.kfp_schedule_list(host=kfp_fake.url)] == ["weekly"]
    assert kfp_target.kfp_schedule_pause("weekly", **quiet)["state"] == "DISABLED"
    assert kfp_fake.calls("POST")[-1].path == f"/apis/v2beta1/recurringruns/{weekly['name']}:disable"
    assert kfp_target.kfp_schedule_resume(weekly["name"], **quiet)["state"] == "ENABLED"
    assert kfp_fake.calls("POST")[-1].path == f"/apis/v2beta1/recurringruns/{weekly['name']}:enable"
    kfp_target.kfp_schedule_delete("weekly", **quiet)
    assert kfp_fake.calls("DELETE")[-1].path == f"/apis/v2beta1/recurringruns/{weekly['name']}"
    assert kfp_target.kfp_schedule_list(host=kfp_fake.url) == []


def test_kfp_errors_are_one_line(kfp_fake: FakeKFP, spec: str, capsys: Any) -> None:
    kfp_fake.fail("POST", "/runs$", 403, "PERMISSION_DENIED", "user alice cannot create runs in namespace kubeflow")
    code = remote_main(["submit", "tiny", "--target", "kfp", "--host", kfp_fake.url])
    assert code == 1
    assert capsys.readouterr().err == ("error: Kubeflow Pipelines refused the pipeline run: 403 user alice cannot "
                                       "create runs in namespace kubeflow\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError, match=rf"cannot connect to Kubeflow Pipelines: http://127.0.0.1:{port} is unreachable"):
        kfp_target.kfp_schedule_list(host=f"http://127.0.0.1:{port}")
    with pytest.raises(UserError, match="no recurring run named 'nope'"):
        kfp_target.kfp_schedule_pause("nope", host=kfp_fake.url)
