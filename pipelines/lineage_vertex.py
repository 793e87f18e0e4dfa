"""Lineage read from Vertex ML Metadata: a Vertex run's artifacts and executions as a LineageView.

A node's identity, stats and config are those components stamp on the KFP artifact from its manifest
(components/kfp_support.py); its config falls back to the run's whole config where none is stamped.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from configs import UserError
from pipelines.lineage_graph import Artifact, LineageView, build_view, config_summary, key_stats

# Artifact metadata keys that components.kfp_support sets besides the stats: identity, and the manifest's config.
IDENTITY_KEYS = ("kind", "version", "step", "code_version", "config")


def vertex_view(
    uri: str, project: str, region: str, max_hops: int | None = None, client: Any = None,
    metadata_store: str = "default",
) -> LineageView:
    """The lineage of a Vertex artifact (by its gs:// URI) from Vertex ML Metadata, as a LineageView.

    Finds the artifact as `aiplatform.Artifact.get_with_uri` does (the newest with that uri), then asks
    `MetadataServiceClient.query_artifact_lineage_subgraph` for the graph around it.
    """
    from google.api_core import exceptions
    from google.auth import exceptions as auth_exceptions
    from google.cloud import aiplatform_v1

    try:
        if client is None:
            client = aiplatform_v1.MetadataServiceClient(
                client_options={"api_endpoint": f"{region}-aiplatform.googleapis.com"})
        parent = f"projects/{project}/locations/{region}/metadataStores/{metadata_store}"
        found = list(client.list_artifacts(request={"parent": parent, "filter": f'uri="{uri}"'}))
        if not found:
            raise UserError(f"no artifact with uri {uri} in Vertex ML Metadata ({parent})")
        name = max(found, key=lambda a: _iso(a.create_time) or "").name
        request: dict[str, Any] = {"artifact": name}
        if max_hops is not None:
            request["max_hops"] = max_hops
        subgraph = client.query_artifact_lineage_subgraph(request=request)
    except exceptions.GoogleAPICallError as err:
        raise UserError(f"Vertex ML Metadata: {err.code.name if err.code else 'error'}: {err.message}") from None
    except auth_exceptions.DefaultCredentialsError:
        raise UserError("no Google Cloud credentials: run `gcloud auth application-default login`") from None
    return view_from_subgraph(subgraph, name)


def view_from_subgraph(subgraph: Any, focus: str) -> LineageView:
    """Convert a Vertex `LineageSubgraph` (artifacts, executions, INPUT/OUTPUT events) into a LineageView."""
    from google.cloud import aiplatform_v1

    executions = {e.name: e for e in subgraph.executions}
    inputs: dict[str, list[str]] = defaultdict(list)  # execution -> artifacts it read
    outputs: dict[str, list[str]] = defaultdict(list)  # execution -> artifacts it wrote
    names = {a.name for a in subgraph.artifacts}
    for event in subgraph.events:
        if event.artifact in names and event.execution in executions:
            is_input = event.type_ == aiplatform_v1.Event.Type.INPUT
            (inputs if is_input else outputs)[event.execution].append(event.artifact)
    producer = {art: ex for ex, arts in outputs.items() for art in arts}
    nodes = {a.name: _vertex_artifact(a, executions.get(producer.get(a.name, ""))) for a in subgraph.artifacts}
    if focus not in nodes:
        raise UserError(f"Vertex ML Metadata returned no lineage for {focus}")
    parents = {name: list(dict.fromkeys(inputs.get(producer.get(name, ""), []))) for name in nodes}
    children: dict[str, list[str]] = defaultdict(list)
    for ex, read in inputs.items():
        for art in dict.fromkeys(read):
            children[art] += [o for o in outputs.get(ex, []) if o not in children[art]]
    for users in children.values():
        users.sort(key=lambda n: (nodes[n].created or "", nodes[n].version))
    return build_view(focus, nodes.__getitem__, lambda k: parents.get(k, []), lambda k: children.get(k, []))


def _vertex_artifact(artifact: Any, execution: Any) -> Artifact:
    """A Vertex artifact as a lineage node: identity from the metadata maxpipe's components stamp on it."""
    metadata = {k: _plain(v) for k, v in _struct(artifact).items()}
    step = metadata.get("step")
    if not isinstance(step, str) or not step:  # an export's stats carry a training `step` number under that key
        step = (execution.display_name if execution is not None else None) or None
    config = metadata.get("config")
    if not isinstance(config, dict):
        config = _execution_config(execution)
    stats = {k: v for k, v in metadata.items() if k not in IDENTITY_KEYS}
    return Artifact(
        kind=str(metadata.get("kind") or artifact.schema_title.removeprefix("system.") or "artifact"),
        version=str(metadata.get("version") or artifact.name.rsplit("/", 1)[-1]),
        uri=artifact.uri, step=step, created=_iso(artifact.create_time),
        code_version=metadata.get("code_version"), config_summary=config_summary(config),
        stats=key_stats(stats), config=config, key=artifact.name,
    )


def _execution_config(execution: Any) -> dict[str, Any]:
    """The whole config a Vertex execution ran with (its `config` input parameter), if recorded."""
    if execution is None:
        return {}
    metadata = _struct(execution)
    raw = metadata.get("input:config", metadata.get("config"))
    try:
        config = raw if isinstance(raw, dict) else json.loads(raw or "{}")
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def _struct(message: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(type(message).pb(message).metadata)


def _plain(value: Any) -> Any:
    """Struct numbers are doubles: whole ones back to ints, inside lists and dicts too."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _iso(timestamp: Any) -> str | None:
    return timestamp.isoformat(timespec="seconds") if timestamp else None
