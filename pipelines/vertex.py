"""Run the compiled pipeline on Vertex AI Pipelines: runs (submit, wait) and pipeline schedules.

Everything goes through the google-cloud-aiplatform SDK (`PipelineJob`, `PipelineJobSchedule`) over
its REST transport. Errors from the service become one `configs.UserError` line naming what failed
and the server's message. The command line is pipelines/remote_cli.py.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from typing import Any

from cloud.polling import wait_for_state
from cloud.vertex_api import api_errors as _api_errors
from cloud.vertex_api import one_line as _one_line
from cloud.vertex_api import vertex_session as _vertex
from configs import UserError
from pipelines.cron import normalize_cron

Log = Callable[[str], None]

_FINAL_STATES = {"PIPELINE_STATE_SUCCEEDED", "PIPELINE_STATE_FAILED", "PIPELINE_STATE_CANCELLED"}
_SCHEDULE_NAME = re.compile(r"projects/[^/]+/locations/[^/]+/schedules/[^/]+")


# ----------------------------------------------------------------------------------------- runs


def submit(
    template_path: str, *, project: str, region: str, pipeline_root: str, display_name: str,
    service_account: str | None = None, network: str | None = None, labels: dict[str, str] | None = None,
    enable_caching: bool | None = None, parameter_values: dict[str, Any] | None = None, wait: bool = False,
    api_endpoint: str | None = None, credentials: Any = None, poll_s: float = 30.0, log: Log = print,
) -> dict[str, Any]:
    """Create a Vertex AI pipeline run from a compiled spec; print and return its console link.

    `enable_caching`: None keeps each task's compile-time setting, True/False forces it on every task.
    `wait`: poll until the run ends, printing each state change; a run that fails raises UserError.
    Returns {"name": resource name, "job_id", "console_url", "state"}.
    """
    _check_pipeline_root(pipeline_root)
    _check_labels(labels)
    with _vertex(project, region, api_endpoint, credentials, log) as creds:
        job = _pipeline_job(template_path, project, region, pipeline_root, display_name, labels,
                            enable_caching, parameter_values, creds)
        with _api_errors("Vertex AI refused the pipeline run"):
            job.submit(service_account=service_account, network=network)
        info = _job_info(job.gca_resource, project, region)
        log(f"submitted {info['name']}")
        log(f"console: {info['console_url']}")
        if wait:
            info["state"] = _wait(job, info, poll_s, log)
    return info


def _wait(job: Any, info: dict[str, Any], poll_s: float, log: Log) -> str:
    def read() -> str:
        with _api_errors(f"cannot read the state of {info['job_id']}"):
            return job.state.name  # a GET of the run

    def show(state: str) -> None:
        log(f"{info['job_id']}: {state.removeprefix('PIPELINE_STATE_').lower()}")

    state = wait_for_state(read, _FINAL_STATES, show, poll_s)
    if state != "PIPELINE_STATE_SUCCEEDED":
        error = job.gca_resource.error.message
        raise UserError(f"pipeline run {info['job_id']} {state.removeprefix('PIPELINE_STATE_').lower()}"
                        f"{': ' + _one_line(error) if error else ''} (see {info['console_url']})")
    return state


# ------------------------------------------------------------------------------------ schedules


def schedule_create(
    template_path: str, *, project: str, region: str, pipeline_root: str, display_name: str, cron: str,
    service_account: str | None = None, network: str | None = None, labels: dict[str, str] | None = None,
    enable_caching: bool | None = None, parameter_values: dict[str, Any] | None = None,
    max_concurrent_runs: int = 1, api_endpoint: str | None = None, credentials: Any = None, log: Log = print,
) -> dict[str, Any]:
    """A Vertex AI pipeline schedule that starts a run of the spec at each `cron` time.

    `cron` is a 5-field unix cron with an optional `TZ=Area/City ` (or `CRON_TZ=`) prefix; without
    one Vertex AI reads it in UTC. Display names must be unique (pause/resume/delete use them), so
    an existing schedule of the same name is an error.
    """
    cron = normalize_cron(cron)
    _check_pipeline_root(pipeline_root)
    _check_labels(labels)
    if max_concurrent_runs < 1:
        raise UserError(f"max concurrent runs must be at least 1 (got {max_concurrent_runs})")
    from google.cloud import aiplatform

    with _vertex(project, region, api_endpoint, credentials, log) as creds:
        clash = [s for s in _list(project, region, creds) if s.display_name == display_name]
        if clash:
            raise UserError(f"a schedule named {display_name!r} already exists ({clash[0].resource_name}); "
                            "delete it first or choose another --display-name")
        job = _pipeline_job(template_path, project, region, pipeline_root, display_name, labels,
                            enable_caching, parameter_values, creds)
        schedule = aiplatform.PipelineJobSchedule(
            pipeline_job=job, display_name=display_name, credentials=creds, project=project, location=region)
        with _api_errors(f"Vertex AI refused the schedule {display_name!r}"):
            schedule.create(cron=cron, max_concurrent_run_count=max_concurrent_runs,
                            service_account=service_account, network=network)
        info = _schedule_info(schedule.gca_resource, project, region)
    log(f"created schedule {info['display_name']!r} ({info['name']}): {info['cron']}, next run {info['next_run']}")
    log(f"console: {info['console_url']}")
    return info


def schedule_list(*, project: str, region: str, api_endpoint: str | None = None, credentials: Any = None,
                  log: Log = print) -> list[dict[str, Any]]:
    """The pipeline schedules of a project and region: name, display name, cron, state, next run."""
    with _vertex(project, region, api_endpoint, credentials, log) as creds:
        return [_schedule_info(s.gca_resource, project, region) for s in _list(project, region, creds)]


def schedule_pause(name_or_display_name: str, *, project: str, region: str, api_endpoint: str | None = None,
                   credentials: Any = None, log: Log = print) -> dict[str, Any]:
    """Stop a schedule from starting runs (runs already started go on)."""
    return _schedule_action("pause", name_or_display_name, project, region, api_endpoint, credentials, log)


def schedule_resume(name_or_display_name: str, *, project: str, region: str, api_endpoint: str | None = None,
                    credentials: Any = None, log: Log = print) -> dict[str, Any]:
    """Let a paused schedule start runs again (missed runs are not caught up)."""
    return _schedule_action("resume", name_or_display_name, project, region, api_endpoint, credentials, log)


def schedule_delete(name_or_display_name: str, *, project: str, region: str, api_endpoint: str | None = None,
                    credentials: Any = None, log: Log = print) -> dict[str, Any]:
    """Delete a schedule (the runs it started stay)."""
    return _schedule_action("delete", name_or_display_name, project, region, api_endpoint, credentials, log)


def _schedule_action(action: str, wanted: str, project: str, region: str, api_endpoint: str | None,
                     credentials: Any, log: Log) -> dict[str, Any]:
    from google.cloud import aiplatform

    with _vertex(project, region, api_endpoint, credentials, log) as creds:
        schedule = _find_schedule(wanted, project, region, creds)
        with _api_errors(f"Vertex AI refused to {action} schedule {schedule.display_name!r}"):
            getattr(schedule, action)()
            if action == "delete":
                info = {**_schedule_info(schedule.gca_resource, project, region), "state": "DELETED"}
            else:
                info = _schedule_info(aiplatform.PipelineJobSchedule.get(
                    schedule.resource_name, project=project, location=region, credentials=creds).gca_resource,
                    project, region)
    log(f"{action}d schedule {info['display_name']!r} ({info['name']}): {info['state'].lower()}")
    return info


def _list(project: str, region: str, creds: Any) -> list[Any]:
    from google.cloud import aiplatform

    with _api_errors(f"cannot list the schedules of project {project} in {region}"):
        return aiplatform.PipelineJobSchedule.list(project=project, location=region, credentials=creds)


def _find_schedule(wanted: str, project: str, region: str, creds: Any) -> Any:
    """A schedule by resource name, numeric id or (unique) display name."""
    from google.cloud import aiplatform

    if _SCHEDULE_NAME.fullmatch(wanted) or wanted.isdigit():
        with _api_errors(f"cannot find schedule {wanted!r}"):
            return aiplatform.PipelineJobSchedule.get(wanted, project=project, location=region, credentials=creds)
    found = [s for s in _list(project, region, creds) if s.display_name == wanted]
    if not found:
        raise UserError(f"no schedule named {wanted!r} in project {project}, region {region} "
                        "(`maxpipe schedule list` shows them)")
    if len(found) > 1:
        raise UserError(f"{len(found)} schedules are named {wanted!r}; name one by its resource name: "
                        + ", ".join(s.resource_name for s in found))
    return found[0]


def _schedule_info(s: Any, project: str, region: str) -> dict[str, Any]:
    sid = s.name.rsplit("/", 1)[-1]
    return {
        "name": s.name,
        "display_name": s.display_name,
        "cron": s.cron,
        "state": s.state.name,
        "next_run": s.next_run_time.isoformat() if "next_run_time" in s else None,
        "max_concurrent_runs": s.max_concurrent_run_count,
        "console_url": f"https://console.cloud.google.com/vertex-ai/locations/{region}/pipelines/schedules/{sid}"
                       f"?project={project}",
    }


# ------------------------------------------------------------------------------ SDK plumbing


def _check_pipeline_root(pipeline_root: str) -> None:
    if not pipeline_root.startswith("gs://"):
        raise UserError(f"--pipeline-root must be a gs:// URI for Vertex AI (got {pipeline_root!r})")


_LABEL_KEY = re.compile(r"[a-z][\w-]{0,62}")
_LABEL_VALUE = re.compile(r"[\w-]{0,63}")


def _check_labels(labels: dict[str, str] | None) -> None:
    """Google Cloud's label rules (the SDK checks only that they are strings; the server would refuse)."""
    for key, value in (labels or {}).items():
        if not (_LABEL_KEY.fullmatch(key) and key == key.lower()):
            raise UserError(f"label key {key!r}: use 1-63 lowercase letters, digits, '_' or '-', starting with a letter")
        if not (_LABEL_VALUE.fullmatch(value) and value == value.lower()):
            raise UserError(f"label {key}={value!r}: values are up to 63 lowercase letters, digits, '_' or '-'")
    if len(labels or {}) > 64:
        raise UserError(f"at most 64 labels (got {len(labels)})")


def _pipeline_job(template_path: str, project: str, region: str, pipeline_root: str, display_name: str,
                  labels: dict[str, str] | None, enable_caching: bool | None,
                  parameter_values: dict[str, Any] | None, creds: Any) -> Any:
    """An unsubmitted PipelineJob. A local template is read here and sent inline as `pipelineSpec`
    (the SDK uploads nothing for a local path); a gs:// or https:// template is fetched by the SDK."""
    from google.cloud import aiplatform

    try:
        return aiplatform.PipelineJob(
            display_name=display_name, template_path=template_path, job_id=_job_id(display_name),
            pipeline_root=pipeline_root,
            parameter_values=parameter_values, enable_caching=enable_caching, labels=labels or None,
            credentials=creds, project=project, location=region,
        )
    except FileNotFoundError:
        raise UserError(f"pipeline spec not found: {template_path}") from None
    except ValueError as err:  # bad labels, display name, region or parameter names
        raise UserError(f"cannot prepare the Vertex AI pipeline run: {_one_line(str(err))}") from None


def _job_id(display_name: str) -> str:
    """`NAME-YYYYMMDD-HHMMSS-XXXX`: the SDK's default (pipeline name + time to the second) collides
    when two runs are submitted within a second; the random suffix keeps ids unique."""
    slug = re.sub(r"[^a-z0-9]+", "-", display_name.lower()).strip("-")[:80] or "run"
    slug = slug if slug[0].isalpha() else f"run-{slug}"
    return f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _job_info(job: Any, project: str, region: str) -> dict[str, Any]:
    job_id = job.name.rsplit("/", 1)[-1]
    return {
        "name": job.name,
        "job_id": job_id,
        "console_url": f"https://console.cloud.google.com/vertex-ai/locations/{region}/pipelines/runs/{job_id}"
                       f"?project={project}",
        "state": job.state.name,
    }
