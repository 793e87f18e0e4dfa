"""Local stand-ins for the Vertex AI REST API and the Kubeflow Pipelines API, for contract tests.

Each fake is a real HTTP server on 127.0.0.1 (a random port) in a background thread. It records
every request it gets (method, path, query, JSON body) and answers the way the real API does for
the calls maxpipe makes, with resources kept in memory. Rules added with `fail(...)` make matching
requests answer with the service's error JSON instead, to test error handling.

FakeVertex speaks the Vertex AI v1 REST surface the google-cloud-aiplatform SDK uses (pipelineJobs
create/get, schedules create/list/get/pause/resume/delete, the delete operation, customJobs
create/get/list/cancel, where a test may run the job's worker pools itself) plus the one Cloud
Storage JSON call `PipelineJob.submit` makes (the bucket-exists check on the pipeline root, reached
through STORAGE_EMULATOR_HOST). FakeKFP speaks the KFP v2beta1 REST API that `kfp.Client` uses.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

Json = dict[str, Any]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any


@dataclass
class _Rule:
    method: str
    path_re: str
    code: int
    status: str
    message: str


class HttpError(Exception):
    def __init__(self, code: int, status: str, message: str):
        super().__init__(message)
        self.code, self.status, self.message = code, status, message


@dataclass
class _FakeServer:
    """The HTTP plumbing shared by the fakes: routing is `route(method, path, query, body)`."""

    requests: list[Request] = field(default_factory=list)
    _rules: list[_Rule] = field(default_factory=list)
    _ids: Any = field(default_factory=lambda: itertools.count(1001))
    on_request: Any = None  # called with (method, path) before each request is answered

    def __enter__(self) -> "_FakeServer":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                path = unquote(url.path)
                fake.requests.append(Request(self.command, path, query, body))
                if fake.on_request:
                    fake.on_request(self.command, path)
                try:
                    for rule in fake._rules:
                        if rule.method in (self.command, "*") and re.search(rule.path_re, path):
                            raise HttpError(rule.code, rule.status, rule.message)
                    code, payload = 200, fake.route(self.command, path, query, body)
                except HttpError as err:
                    code, payload = err.code, fake.error_body(err)
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = _handle

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail(self, method: str, path_re: str, code: int, status: str, message: str) -> None:
        """Answer requests matching `method` ("*" = any) and the path regex with an error."""
        self._rules.append(_Rule(method, path_re, code, status, message))

    def calls(self, method: str | None = None, path_re: str = "") -> list[Request]:
        return [r for r in self.requests if (method is None or r.method == method) and re.search(path_re, r.path)]

    def route(self, method: str, path: str, query: dict[str, str], body: Any) -> Json:
        raise NotImplementedError

    def error_body(self, err: HttpError) -> Json:
        raise NotImplementedError


@dataclass
class FakeVertex(_FakeServer):
    """Vertex AI v1 REST (pipelineJobs, schedules, operations) and Cloud Storage bucket lookups."""

    jobs: dict[str, Json] = field(default_factory=dict)
    schedules: dict[str, Json] = field(default_factory=dict)
    job_states: list[str] = field(default_factory=lambda: ["PIPELINE_STATE_SUCCEEDED"])
    job_error: Json | None = None
    custom_jobs: dict[str, Json] = field(default_factory=dict)
    # Runs a created custom job (its JSON body) and returns an error message, or None for success;
    # called in a thread, the job shows as running until it returns. None: jobs succeed at once.
    run_custom_job: Any = None

    def error_body(self, err: HttpError) -> Json:
        # google.rpc.Status as the JSON error body of a Google REST API (AIP-193).
        return {"error": {"code": err.code, "message": err.message, "status": err.status}}

    def route(self, method: str, path: str, query: dict[str, str], body: Any) -> Json:
        if m := re.fullmatch(r"/storage/v1/b/([^/]+)", path):
            return {"kind": "storage#bucket", "name": m.group(1), "id": m.group(1)}
        m = re.fullmatch(
            r"/v1/(projects/[^/]+/locations/[^/]+)/(pipelineJobs|schedules|customJobs)(?:/([^/:]+))?(?::(\w+))?", path)
        if not m:
            raise HttpError(404, "NOT_FOUND", f"no such method: {method} {path}")
        parent, kind, rid, verb = m.groups()
        if kind == "pipelineJobs":
            return self._job(method, parent, rid, query, body)
        if kind == "customJobs":
            return self._custom_job(method, parent, rid, verb, query, body)
        return self._schedule(method, parent, rid, verb, body)

    def _job(self, method: str, parent: str, rid: str | None, query: dict[str, str], body: Json) -> Json:
        if method == "POST" and rid is None:
            name = f"{parent}/pipelineJobs/{query.get('pipelineJobId') or next(self._ids)}"
            if name in self.jobs:
                raise HttpError(409, "ALREADY_EXISTS", f"PipelineJob {name} already exists")
            self.jobs[name] = {**body, "name": name, "state": "PIPELINE_STATE_PENDING",
                               "createTime": "2026-11-20T10:00:00Z"}
            return self.jobs[name]
        name = f"{parent}/pipelineJobs/{rid}"
        if method == "GET" and name in self.jobs:
            job = self.jobs[name]
            # Each poll moves the job one state along `job_states`; the last one sticks.
            polls = job.setdefault("_polls", 0)
            job["_polls"] = polls + 1
            job["state"] = self.job_states[min(polls, len(self.job_states) - 1)]
            if job["state"] == "PIPELINE_STATE_FAILED" and self.job_error:
                job["error"] = self.job_error
            return {k: v for k, v in job.items() if not k.startswith("_")}
        raise HttpError(404, "NOT_FOUND", f"PipelineJob {name} not found")

    def _custom_job(self, method: str, parent: str, rid: str | None, verb: str | None, query: dict[str, str],
                    body: Json) -> Json:
        if method == "GET" and rid is None:
            m = re.fullmatch(r'display_name="([^"]*)"', query.get("filter", ""))
            wanted = m.group(1) if m else None
            mine = [dict(j) for n, j in self.custom_jobs.items()
                    if n.startswith(parent + "/") and wanted in (None, j.get("displayName"))]
            return {"customJobs": mine} if mine else {}
        if method == "POST" and rid is None:
            name = f"{parent}/customJobs/{next(self._ids)}"
            job = self.custom_jobs[name] = {**body, "name": name, "state": "JOB_STATE_PENDING",
                                            "createTime": "2026-11-20T10:00:00Z"}
            if self.run_custom_job is None:
                job["state"] = "JOB_STATE_SUCCEEDED"
            else:
                def run() -> None:
                    job["state"] = "JOB_STATE_RUNNING"
                    error = self.run_custom_job(body)
                    if error:
                        job["error"] = {"code": 13, "message": error}
                    job["state"] = "JOB_STATE_FAILED" if error else "JOB_STATE_SUCCEEDED"

                threading.Thread(target=run, daemon=True).start()
            return {k: v for k, v in job.items() if k != "state"} | {"state": "JOB_STATE_PENDING"}
        name = f"{parent}/customJobs/{rid}"
        if method == "GET" and name in self.custom_jobs:
            return dict(self.custom_jobs[name])
        if method == "POST" and verb == "cancel" and name in self.custom_jobs:
            self.custom_jobs[name]["state"] = "JOB_STATE_CANCELLED"
            return {}
        raise HttpError(404, "NOT_FOUND", f"CustomJob {name} not found")

    def _schedule(self, method: str, parent: str, rid: str | None, verb: str | None, body: Json) -> Json:
        if rid is None and method == "POST":
            name = f"{parent}/schedules/{next(self._ids)}"
            self.schedules[name] = {**body, "name": name, "state": "ACTIVE", "createTime": "2026-11-20T10:00:00Z",
                                    "nextRunTime": "2026-11-23T02:00:00Z", "startedRunCount": "0"}
            return self.schedules[name]
        if rid is None and method == "GET":
            mine = [s for n, s in self.schedules.items() if n.startswith(parent + "/")]
            return {"schedules": mine} if mine else {}
        name = f"{parent}/schedules/{rid}"
        if name not in self.schedules:
            raise HttpError(404, "NOT_FOUND", f"Schedule {name} not found")
        if method == "GET" and verb is None:
            return self.schedules[name]
        if method == "POST" and verb in ("pause", "resume"):
            self.schedules[name]["state"] = "PAUSED" if verb == "pause" else "ACTIVE"
            return {}
        if method == "DELETE" and verb is None:
            del self.schedules[name]
            # A long-running operation that is already done, as the REST API returns for quick deletes.
            return {"name": f"{parent}/operations/{next(self._ids)}", "done": True,
                    "response": {"@type": "type.googleapis.com/google.protobuf.Empty"}}
        raise HttpError(400, "INVALID_ARGUMENT", f"unsupported: {method} {name}:{verb}")


@dataclass
class FakeKFP(_FakeServer):
    """Kubeflow Pipelines v2beta1 REST: healthz, experiments, runs, recurring runs."""

    experiments: dict[str, Json] = field(default_factory=dict)
    runs: dict[str, Json] = field(default_factory=dict)
    recurring: dict[str, Json] = field(default_factory=dict)
    run_state: str = "SUCCEEDED"

    def error_body(self, err: HttpError) -> Json:
        # The KFP API server answers errors as a grpc-gateway status.
        return {"error": err.message, "code": _GRPC_CODES.get(err.status, 2), "message": err.message, "details": []}

    def route(self, method: str, path: str, query: dict[str, str], body: Any) -> Json:
        m = re.fullmatch(r"/apis/v2beta1/(\w+)(?:/([^/:]+))?(?::(\w+))?", path)
        if not m:
            raise HttpError(404, "NOT_FOUND", f"Not Found: {method} {path}")
        kind, rid, verb = m.groups()
        if kind == "healthz":
            return {"multi_user": False}
        if kind == "experiments":
            if method == "POST":
                eid = str(next(self._ids))
                self.experiments[eid] = {**body, "experiment_id": eid, "storage_state": "AVAILABLE"}
                return self.experiments[eid]
            m = re.fullmatch(r'display_name="([^"]*)"', query.get("filter", ""))
            wanted = m.group(1) if m else None
            found = [e for e in self.experiments.values() if wanted is None or e["display_name"] == wanted]
            return {"experiments": found, "total_size": len(found)} if found else {}
        if kind == "runs":
            if method == "POST":
                rid = str(next(self._ids))
                self.runs[rid] = {**body, "run_id": rid, "state": "PENDING", "created_at": "2026-11-20T10:00:00Z"}
                return self.runs[rid]
            if rid in self.runs:
                self.runs[rid]["state"] = self.run_state
                return self.runs[rid]
            raise HttpError(404, "NOT_FOUND", f"run {rid} not found")
        if kind == "recurringruns":
            if method == "POST" and rid is None:
                rid = str(next(self._ids))
                self.recurring[rid] = {**body, "recurring_run_id": rid, "status": body.get("mode", "ENABLE") + "D",
                                       "created_at": "2026-11-20T10:00:00Z"}
                return self.recurring[rid]
            if method == "GET" and rid is None:
                found = list(self.recurring.values())
                return {"recurringRuns": found, "total_size": len(found)} if found else {}
            if rid not in self.recurring:
                raise HttpError(404, "NOT_FOUND", f"recurring run {rid} not found")
            if method == "POST" and verb in ("enable", "disable"):
                self.recurring[rid]["status"] = verb.upper() + "D"
                self.recurring[rid]["mode"] = verb.upper()
                return {}
            if method == "DELETE":
                del self.recurring[rid]
                return {}
            return self.recurring[rid]
        raise HttpError(404, "NOT_FOUND", f"Not Found: {method} {path}")


_GRPC_CODES = {"INVALID_ARGUMENT": 3, "NOT_FOUND": 5, "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "UNAUTHENTICATED": 16}


def _filter_value(raw: str | None, key: str) -> str | None:
    """The string value a KFP list filter (JSON predicates) compares `key` with."""
    if not raw:
        return None
    for pred in json.loads(raw).get("predicates", []):
        if pred.get("key") == key:
            return pred.get("stringValue", pred.get("string_value"))
    return None
