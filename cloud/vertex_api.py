"""Talking to the Vertex AI API: one SDK session per call, offline-testable endpoints, one-line errors.

Shared by pipeline runs and schedules (pipelines/vertex.py) and custom jobs (cloud/custom_job.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from configs import UserError

Log = Callable[[str], None]

SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
NO_CREDENTIALS = (
    "no Google Cloud credentials found: run `gcloud auth application-default login` "
    "(or point GOOGLE_APPLICATION_CREDENTIALS at a service-account key file)"
)


@contextlib.contextmanager
def vertex_session(project: str, region: str, api_endpoint: str | None, credentials: Any, log: Log) -> Iterator[Any]:
    """Point the SDK at the API (REST transport) with the given or default credentials, for one call.

    The SDK keeps the endpoint and the transport only in its process-wide config (`aiplatform.init`
    can set the endpoint but never clear it), so they are set here and restored afterwards.
    We always use the REST transport: it is the path the tests exercise, needs no gRPC channel,
    and accepts an endpoint with a scheme: the transport prefixes `https://` only to an endpoint
    without one (rest_base.py: `host = f"{url_scheme}://{host}" if not url_match_items["scheme"]`),
    so `api_endpoint="http://127.0.0.1:PORT"` talks plain HTTP to a local stand-in (anonymously),
    while a bare host (`europe-west4-aiplatform.googleapis.com`, a Private Service Connect name)
    stays on HTTPS with the user's credentials.
    """
    if not project or not region:
        raise UserError("Vertex AI needs a project and a region (--project, --region)")
    from google.cloud.aiplatform import initializer, utils

    try:
        utils.validate_region(region)
    except ValueError:
        raise UserError(f"unknown Vertex AI region {region!r} (e.g. us-central1, europe-west4; "
                        "https://cloud.google.com/vertex-ai/docs/general/locations)") from None
    if credentials is None and (api_endpoint or "").startswith("http://"):
        # Plain HTTP is only for a local stand-in of the API: never send a bearer token over it.
        from google.auth.credentials import AnonymousCredentials

        credentials = AnonymousCredentials()
    creds = credentials or _default_credentials()
    config = initializer.global_config
    saved = config._api_endpoint, config._api_transport
    config._api_endpoint, config._api_transport = api_endpoint, "rest"
    try:
        with sdk_logs(log):
            yield creds
    finally:
        config._api_endpoint, config._api_transport = saved


def _default_credentials() -> Any:
    import google.auth
    from google.auth import exceptions

    try:
        creds, _ = google.auth.default(scopes=SCOPES)
    except exceptions.DefaultCredentialsError as err:
        detail = f" ({one_line(str(err))})" if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") else ""
        raise UserError(NO_CREDENTIALS + detail) from None
    return creds


@contextlib.contextmanager
def api_errors(action: str) -> Iterator[None]:
    """Turn what the API or the network answered into one UserError line starting with `action`."""
    import requests
    from google.api_core import exceptions as api_exceptions
    from google.auth import exceptions as auth_exceptions

    try:
        yield
    except api_exceptions.GoogleAPICallError as err:
        raise UserError(f"{action}: {google_error(err)}") from err
    except auth_exceptions.DefaultCredentialsError:
        raise UserError(NO_CREDENTIALS) from None
    except auth_exceptions.RefreshError as err:
        raise UserError(f"{action}: Google Cloud credentials could not be refreshed ({one_line(str(err))}); "
                        "run `gcloud auth application-default login`") from err
    except requests.exceptions.ConnectionError as err:
        url = getattr(err.request, "url", None) or "the Vertex AI API"
        raise UserError(f"{action}: cannot reach {url.split('?')[0]} ({type(err).__name__})") from err


def google_error(err: Any) -> str:
    """`403 <the server's message>` from a google.api_core error (REST: read from the error JSON)."""
    message = err.message
    response = getattr(err, "response", None)
    if response is not None and hasattr(response, "json"):
        with contextlib.suppress(Exception):
            message = response.json()["error"]["message"]
    code = err.code if isinstance(err.code, int) else getattr(err.code, "value", (err.code,))[0]
    return f"{code} {one_line(message)}"


def one_line(text: str) -> str:
    """`text` with its whitespace runs (newlines too) collapsed to single spaces."""
    return " ".join(str(text).split())


@contextlib.contextmanager
def sdk_logs(log: Log) -> Iterator[None]:
    """Keep the SDK's INFO chatter (and tracebacks) off the terminal during one call.

    The SDK's loggers each print INFO to stdout; we print our own short lines instead. One record
    matters: `PipelineJob.submit` checks (and creates if missing) the pipeline root's bucket and,
    if that fails, logs the exception with its traceback and goes on; it becomes a one-line warning.
    """

    class Quiet(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.exc_info and record.exc_info[1] is not None:
                log(f"warning: {record.getMessage()}: {one_line(str(record.exc_info[1]))[:300]}")
                return False
            return record.levelno >= logging.WARNING

    quiet = Quiet()
    loggers = [lg for name, lg in logging.root.manager.loggerDict.items()
               if name.startswith("google.cloud.aiplatform") and isinstance(lg, logging.Logger)]
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)
