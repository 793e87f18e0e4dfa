"""Run the compiled pipeline on a Kubeflow Pipelines deployment: runs and recurring runs, via kfp.Client.

The same spec that Vertex AI runs; `host` is the KFP API (e.g. http://localhost:8080 after
`kubectl port-forward svc/ml-pipeline-ui 8080:80 -n kubeflow`). Authentication follows kfp.Client:
KF_PIPELINES_* environment variables, a kube context, or none for a port-forward. Errors become one
`configs.UserError` line.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from cloud.polling import wait_for_state
from configs import UserError
from pipelines.cron import normalize_cron

Log = Callable[[str], None]

_FINAL_STATES = {"SUCCEEDED", "SKIPPED", "FAILED", "CANCELED"}


def kfp_submit(
    template_path: str, *, host: str, run_name: str, experiment: str | None = None,
    pipeline_root: str | None = None, enable_caching: bool | None = None, service_account: str | None = None,
    namespace: str | None = None, wait: bool = False, poll_s: float = 30.0, log: Log = print,
) -> dict[str, Any]:
    """Start a run of the spec (in `experiment`, KFP's "Default" if None); print and return its link.

    `service_account` is a Kubernetes service account here. Returns {"name": run id, "url", "state"}.
    """
    client = _client(host, namespace)
    with _kfp_errors("Kubeflow Pipelines refused the pipeline run", host), _quiet():
        result = client.create_run_from_pipeline_package(
            template_path, run_name=run_name, experiment_name=experiment, namespace=namespace,
            pipeline_root=pipeline_root, enable_caching=enable_caching, service_account=service_account,
        )
    info = {"name": result.run_id, "url": f"{_ui(host)}/#/runs/details/{result.run_id}",
            "state": _state(result.run_info.state)}
    log(f"submitted run {info['name']}")
    log(f"console: {info['url']}")
    if wait:
        run = None

        def read() -> str:
            nonlocal run
            with _kfp_errors(f"cannot read the state of run {info['name']}", host):
                run = client.get_run(info["name"])
            return _state(run.state)

        state = wait_for_state(read, _FINAL_STATES, lambda s: log(f"{info['name']}: {s.lower()}"), poll_s)
        info["state"] = state
        if state != "SUCCEEDED":
            error = getattr(run.error, "message", None) if run.error else None
            raise UserError(f"pipeline run {info['name']} {state.lower()}{': ' + error if error else ''} "
                            f"(see {info['url']})")
    return info


def kfp_schedule_create(
    template_path: str, *, host: str, display_name: str, cron: str, experiment: str | None = None,
    pipeline_root: str | None = None, enable_caching: bool | None = None, service_account: str | None = None,
    max_concurrent_runs: int = 1, namespace: str | None = None, log: Log = print,
) -> dict[str, Any]:
    """A KFP recurring run of the spec at each `cron` time (same cron syntax as Vertex AI).

    KFP's scheduler reads 6-field crons with seconds first, so `0 3 * * 1` is sent as `0 0 3 * * 1`;
    a TZ= prefix is passed on. Missed runs are not caught up (`no_catchup`), as on Vertex AI.
    """
    kfp_cron = to_kfp_cron(cron)
    client = _client(host, namespace)
    if any(r["display_name"] == display_name for r in _list_recurring(client, host, namespace)):
        raise UserError(f"a recurring run named {display_name!r} already exists; delete it first or choose "
                        "another --display-name")
    with _kfp_errors(f"Kubeflow Pipelines refused the recurring run {display_name!r}", host), _quiet():
        experiment_id = client.create_experiment(experiment or "Default", namespace=namespace).experiment_id
        run = client.create_recurring_run(
            experiment_id, display_name, cron_expression=kfp_cron, max_concurrency=max_concurrent_runs,
            no_catchup=True, pipeline_package_path=template_path, pipeline_root=pipeline_root,
            enable_caching=enable_caching, service_account=service_account,
        )
    info = _recurring_info(run, host)
    log(f"created recurring run {display_name!r} ({info['name']}): {info['cron']}")
    log(f"console: {info['url']}")
    return info


def kfp_schedule_list(*, host: str, namespace: str | None = None, log: Log = print) -> list[dict[str, Any]]:
    """The deployment's recurring runs: name (id), display name, cron, state (next run: not in the API)."""
    return _list_recurring(_client(host, namespace), host, namespace)


def _list_recurring(client: Any, host: str, namespace: str | None) -> list[dict[str, Any]]:
    rows, token = [], ""
    with _kfp_errors("cannot list the recurring runs", host):
        while True:
            page = client.list_recurring_runs(page_token=token, page_size=100, namespace=namespace)
            rows += [_recurring_info(r, host) for r in page.recurring_runs or []]
            token = page.next_page_token
            if not token:
                return rows


def kfp_schedule_pause(name_or_display_name: str, *, host: str, namespace: str | None = None,
                       log: Log = print) -> dict[str, Any]:
    """Stop a recurring run from starting runs (KFP: disable it)."""
    return _action("disable", "paused", name_or_display_name, host, namespace, log)


def kfp_schedule_resume(name_or_display_name: str, *, host: str, namespace: str | None = None,
                        log: Log = print) -> dict[str, Any]:
    """Let a paused recurring run start runs again (KFP: enable it)."""
    return _action("enable", "resumed", name_or_display_name, host, namespace, log)


def kfp_schedule_delete(name_or_display_name: str, *, host: str, namespace: str | None = None,
                        log: Log = print) -> dict[str, Any]:
    """Delete a recurring run (the runs it started stay)."""
    return _action("delete", "deleted", name_or_display_name, host, namespace, log)


def _action(verb: str, done: str, wanted: str, host: str, namespace: str | None, log: Log) -> dict[str, Any]:
    client = _client(host, namespace)
    rows = _list_recurring(client, host, namespace)
    found = [r for r in rows if r["name"] == wanted] or [r for r in rows if r["display_name"] == wanted]
    if not found:
        raise UserError(f"no recurring run named {wanted!r} at {host} (`maxpipe schedule list --target kfp` shows them)")
    if len(found) > 1:
        raise UserError(f"{len(found)} recurring runs are named {wanted!r}; name one by its id: "
                        + ", ".join(r["name"] for r in found))
    info = found[0]
    with _kfp_errors(f"Kubeflow Pipelines refused to {verb} recurring run {info['display_name']!r}", host):
        getattr(client, f"{verb}_recurring_run")(info["name"])
        if verb == "delete":
            info["state"] = "DELETED"
        else:
            info = _recurring_info(client.get_recurring_run(info["name"]), host)
    log(f"{done} recurring run {info['display_name']!r} ({info['name']}): {info['state'].lower()}")
    return info


def to_kfp_cron(cron: str) -> str:
    """A 5-field cron (optional TZ= prefix) as KFP's 6-field, seconds-first cron."""
    text = normalize_cron(cron)
    if text.startswith("TZ="):
        tz, fields = text.split(" ", 1)
        return f"{tz} 0 {fields}"
    return f"0 {text}"


def _recurring_info(r: Any, host: str) -> dict[str, Any]:
    cron = r.trigger.cron_schedule.cron if r.trigger and r.trigger.cron_schedule else None
    return {"name": r.recurring_run_id, "display_name": r.display_name, "cron": cron,
            "state": _state(r.status), "next_run": None,
            "url": f"{_ui(host)}/#/recurringrun/details/{r.recurring_run_id}"}


def _state(value: Any) -> str:
    return str(value or "UNKNOWN").rsplit(".", 1)[-1]


def _ui(host: str) -> str:
    """Where links point: the API host (kfp.Client's own default for the UI), https:// if no scheme given."""
    host = host.rstrip("/")
    return host if host.startswith(("http://", "https://")) else f"https://{host}"


def _client(host: str, namespace: str | None) -> Any:
    """kfp.Client for `host`, without its 25 s of healthz retries (with tracebacks) on a bad host."""
    import kfp

    class Client(kfp.Client):
        def get_kfp_healthz(self, sleep_duration: int = 5) -> Any:
            with _kfp_errors("cannot connect to Kubeflow Pipelines", host):
                return self._healthz_api.healthz_service_get_healthz()

    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore", FutureWarning)  # "This client only works with KFP v2.0.0-beta.2 and later"
        return Client(host=host, namespace=namespace or "kubeflow")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """kfp.Client prints links ("Experiment details: ...") and urllib3 logs each retry; we print our own lines."""
    urllib3_log = logging.getLogger("urllib3")
    level = urllib3_log.level
    urllib3_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        urllib3_log.setLevel(level)


@contextlib.contextmanager
def _kfp_errors(action: str, host: str) -> Iterator[None]:
    import kfp_server_api
    import urllib3

    try:
        yield
    except kfp_server_api.ApiException as err:
        message = err.reason or ""
        with contextlib.suppress(Exception):
            body = json.loads(err.body)
            message = body.get("message") or body.get("error") or message
        raise UserError(f"{action}: {err.status} {' '.join(str(message).split())}") from err
    except (urllib3.exceptions.HTTPError, OSError) as err:
        reason = str(getattr(err, "reason", None) or err).rsplit(": ", 1)[-1]  # e.g. "[Errno 111] Connection refused"
        raise UserError(f"{action}: {host} is unreachable ({' '.join(reason.split())[:200]})") from err

