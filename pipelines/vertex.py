"""Run the compiled pipeline on Google Cloud: Vertex AI Pipelines runs and schedules.

    maxpipe submit [PRESET] [key=value ...] --project P --region R --pipeline-root gs://B/PATH
                   [--display-name N] [--service-account SA] [--network NET] [--labels k=v ...]
                   [--no-cache] [--wait] [--api-endpoint URL]
                   [--target kfp --host URL [--namespace NS] [--experiment E]]
    maxpipe schedule create [PRESET] [key=value ...] --cron "TZ=Europe/Paris 0 3 * * 1" [submit options]
                            [--max-concurrent-runs N]
    maxpipe schedule list                     --project P --region R  (or --target kfp --host URL)
    maxpipe schedule pause|resume|delete NAME --project P --region R  (NAME: display name, id or resource name)

Everything goes through the google-cloud-aiplatform SDK (`PipelineJob`, `PipelineJobSchedule`) over
its REST transport; Kubeflow Pipelines goes through `kfp.Client` (pipelines/kfp_target.py). Errors
from the service become one `configs.UserError` line naming what failed and the server's message.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
import tempfile
import time
import zoneinfo
from collections.abc import Callable, Sequence
from typing import Any

from components.polling import wait_for_state
from components.vertex_api import api_errors as _api_errors
from components.vertex_api import one_line as _one_line
from components.vertex_api import vertex_session as _vertex
from configs import UserError

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


_CRON_TZ = re.compile(r"(?:CRON_)?TZ=(\S+)\s+(.*)")


def normalize_cron(cron: str) -> str:
    """Check a cron (5 fields, optional `TZ=Area/City` prefix) here rather than on the server."""
    text = " ".join(cron.split())
    tz, fields = None, text
    if m := _CRON_TZ.fullmatch(text):
        tz, fields = m.groups()
        try:
            zoneinfo.ZoneInfo(tz)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise UserError(f"cron {cron!r}: unknown time zone {tz!r} (an IANA name such as Europe/Paris)") from None
    if len(fields.split()) != 5:
        raise UserError(f"cron {cron!r}: expected 5 fields (minute hour day-of-month month day-of-week), "
                        f"optionally after TZ=Area/City, e.g. 'TZ=Europe/Paris 0 3 * * 1'")
    return f"TZ={tz} {fields}" if tz else fields


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


# ----------------------------------------------------------------------------------- the CLI


def vertex_main(argv: Sequence[str]) -> int:
    """`maxpipe submit ...` and `maxpipe schedule create|list|pause|resume|delete ...`.

    Errors are printed as one `error: ...` line (exit status 1); with `--debug` they are raised.
    """
    argv = list(argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return _vertex_main(argv)
    except UserError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - one line without --debug, like the rest of the CLI
        if debug:
            raise
        print(f"error: {type(err).__name__}: {_one_line(str(err))} (rerun with --debug for the traceback)",
              file=sys.stderr)
    return 1


def _vertex_main(argv: list[str]) -> int:
    if argv[:1] == ["submit"]:
        command, rest = "submit", argv[1:]
    elif argv[:1] == ["schedule"] and argv[1:2] and argv[1] in ("create", "list", "pause", "resume", "delete"):
        command, rest = f"schedule {argv[1]}", argv[2:]
    else:
        raise UserError("expected `submit ...` or `schedule create|list|pause|resume|delete ...`")
    args = _parser(command).parse_intermixed_args(rest)
    kfp = args.target == "kfp"
    if kfp and not args.host:
        raise UserError("--target kfp needs --host URL (the Kubeflow Pipelines API, e.g. http://localhost:8080)")
    if not kfp:
        args.project = args.project or os.environ.get("GOOGLE_CLOUD_PROJECT")
        args.region = args.region or os.environ.get("GOOGLE_CLOUD_REGION")
        if not args.project or not args.region:
            raise UserError("Vertex AI needs --project and --region (or GOOGLE_CLOUD_PROJECT, GOOGLE_CLOUD_REGION)")
    where = ({"host": args.host, "namespace": args.namespace} if kfp else
             {"project": args.project, "region": args.region, "api_endpoint": args.api_endpoint})

    if command in ("submit", "schedule create"):
        return _submit_or_create(command, args, kfp, where)
    if command == "schedule list":
        if kfp:
            from pipelines import kfp_target

            rows = kfp_target.kfp_schedule_list(**where)
        else:
            rows = schedule_list(**where)
        print(_table(rows))
        return 0
    action = command.split()[1]
    if kfp:
        from pipelines import kfp_target

        getattr(kfp_target, f"kfp_schedule_{action}")(args.name, **where)
    else:
        globals()[f"schedule_{action}"](args.name, **where)
    return 0


def _submit_or_create(command: str, args: argparse.Namespace, kfp: bool, where: dict[str, Any]) -> int:
    from configs import load_config, parse_override
    from pipelines.dag import compile_pipeline

    if not kfp and not args.pipeline_root:
        raise UserError("Vertex AI needs --pipeline-root gs://BUCKET/PATH (where runs write their artifacts)")
    if kfp and (args.network or args.labels):
        raise UserError("--network and --labels apply to Vertex AI only")
    preset, overrides = _preset_and_overrides(args.items)
    if args.pipeline_root and not any(parse_override(o)[0] == ["pipeline", "root"] for o in overrides):
        overrides.append(f"pipeline.root={args.pipeline_root}")  # the steps write under the run's root
    cfg = load_config(preset, overrides)
    if kfp and cfg.resources.train.custom_job:
        raise UserError("multi-host training (resources.train.replicas > 1 or tpu_topology) runs as a Vertex AI "
                        "custom job: submit with --target vertex, or train on one machine on Kubeflow")
    labels = _labels(args.labels)
    caching = False if args.no_cache else None  # None: keep each step's compile-time caching setting
    display_name = args.display_name or cfg.pipeline.name
    with tempfile.TemporaryDirectory(prefix="maxpipe-") as tmp:
        spec = os.path.join(tmp, "pipeline.yaml")
        compile_pipeline(cfg, spec, args.service_account or "", "" if kfp else args.network or "")
        if kfp:
            from pipelines import kfp_target

            common = dict(pipeline_root=args.pipeline_root, enable_caching=caching,
                          service_account=args.service_account, experiment=args.experiment, **where)
            if command == "submit":
                kfp_target.kfp_submit(spec, run_name=display_name, wait=args.wait, **common)
            else:
                kfp_target.kfp_schedule_create(spec, display_name=display_name, cron=args.cron,
                                               max_concurrent_runs=args.max_concurrent_runs, **common)
            return 0
        common = dict(pipeline_root=args.pipeline_root, display_name=display_name, enable_caching=caching,
                      service_account=args.service_account, network=args.network, labels=labels, **where)
        if command == "submit":
            submit(spec, wait=args.wait, **common)
        else:
            schedule_create(spec, cron=args.cron, max_concurrent_runs=args.max_concurrent_runs, **common)
    return 0


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"maxpipe {command}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if command in ("submit", "schedule create"):
        parser.add_argument("items", nargs="*", metavar="[PRESET] key=value", help="a preset and config overrides")
    elif command != "schedule list":
        parser.add_argument("name", help="the schedule: display name, id or resource name")
    parser.add_argument("--target", choices=("vertex", "kfp"), default="vertex")
    parser.add_argument("--project", help="Google Cloud project (default: $GOOGLE_CLOUD_PROJECT)")
    parser.add_argument("--region", help="Vertex AI region, e.g. europe-west4 (default: $GOOGLE_CLOUD_REGION)")
    parser.add_argument("--api-endpoint", help="another Vertex AI endpoint (Private Service Connect, a test server)")
    parser.add_argument("--host", help="Kubeflow Pipelines API URL (with --target kfp)")
    parser.add_argument("--namespace", help="Kubeflow Pipelines namespace (multi-user deployments)")
    if command in ("submit", "schedule create"):
        parser.add_argument("--pipeline-root", help="where runs write artifacts: gs://BUCKET/PATH")
        parser.add_argument("--display-name", help="the run's or schedule's name (default: pipeline.name)")
        parser.add_argument("--service-account", help="the service account runs execute as")
        parser.add_argument("--network", help="VPC to peer with: projects/NUMBER/global/networks/NAME")
        parser.add_argument("--labels", nargs="+", action="extend", default=[], metavar="k=v",
                            help="labels for the run (Vertex AI)")
        parser.add_argument("--no-cache", action="store_true", help="rerun every step (no Vertex/KFP caching)")
        parser.add_argument("--experiment", help="Kubeflow Pipelines experiment (with --target kfp)")
    if command == "submit":
        parser.add_argument("--wait", action="store_true", help="wait for the run to end, showing its state")
    if command == "schedule create":
        parser.add_argument("--cron", required=True, help="'0 3 * * 1', optionally 'TZ=Europe/Paris 0 3 * * 1'")
        parser.add_argument("--max-concurrent-runs", type=int, default=1)
    return parser


def _preset_and_overrides(items: Sequence[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def _labels(items: Sequence[str]) -> dict[str, str]:
    labels = {}
    for item in (part for raw in items for part in raw.split(",") if part):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"label {item!r} is not of the form key=value")
        labels[key] = value
    return labels


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no schedules"
    cols = ("display_name", "state", "cron", "next_run", "name")
    cells = [[str(r.get(c) or "-") for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)
