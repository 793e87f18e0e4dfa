"""`maxpipe lineage`: which data, checkpoint and config produced an artifact, and what was made from it.

    maxpipe lineage show REF [--root DIR] [--json | --format tree|json|mermaid|dot|html] [-o FILE]
    maxpipe lineage show gs://... --project P --region R       (read from Vertex ML Metadata)
    maxpipe lineage list [--root DIR] [--kind K] [--json]
    maxpipe lineage rebuild ROOT

REF is a version (a unique prefix will do), an artifact directory or a URI. Local runs are indexed in
`{pipeline root}/lineage.sqlite`, which `rebuild` recreates from storage alone: the manifests under
the root and the run records in `{root}/pipeline_runs/`.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from configs import UserError
from pipelines.lineage_render import FORMATS, list_json, list_text, render
from pipelines.lineage_store import (
    Artifact, LineageStore, LineageView, Tree, build_view, config_summary, key_stats, load_manifest, store_path,
)

__all__ = [
    "Artifact", "LineageStore", "LineageView", "Tree", "lineage_main", "render", "store_path",
    "vertex_view", "view_from_subgraph",
]
DEFAULT_ROOT = "runs"  # configs/base.yml: pipeline.root
# Artifact metadata keys that components.kfp_support sets besides the stats.
IDENTITY_KEYS = ("kind", "version", "step", "code_version")
# The config sections each step reads (a Vertex execution carries the whole config as its `config` input).
STEP_SECTIONS = {"prep": ("data",), "ingest": ("model",), "train": ("model", "train"), "export": ("model",),
                 "eval": ("eval",)}


def lineage_main(argv: list[str]) -> int:
    """Run `maxpipe lineage ...` (argv after `lineage`); errors are raised as one-line UserErrors."""
    args = _parser().parse_args(argv)
    if args.command == "show":
        text = render(_show_view(args), "json" if args.json else args.format)
        _emit(text, args.output)
    elif args.command == "list":
        with _open_store(args.root) as store:
            rows = store.list(args.kind)
            if args.kind and not rows:
                kinds = ", ".join(store.kinds()) or "none"
                raise UserError(f"no {args.kind} artifacts in {store.path} (kinds there: {kinds})")
        print(list_json(rows) if args.json else list_text(rows))
    else:
        if not Path(args.root).is_dir():
            raise UserError(f"{args.root} is not a directory")
        with LineageStore(store_path(args.root)) as store:
            count = store.rebuild(args.root)
        print(f"indexed {count} artifacts under {args.root} into {store_path(args.root)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maxpipe lineage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="an artifact's upstream tree and downstream users")
    show.add_argument("ref", metavar="REF", help="a version (or a unique prefix), an artifact directory or a URI")
    show.add_argument("--root", default=DEFAULT_ROOT, help="the pipeline root holding lineage.sqlite (default: runs)")
    show.add_argument("--format", choices=FORMATS, default="tree", help="tree (default), json, mermaid, dot or html")
    show.add_argument("--json", action="store_true", help="same as --format json")
    show.add_argument("-o", "--output", help="write to this file instead of stdout")
    show.add_argument("--project", help="Google Cloud project: read a gs:// artifact's lineage from Vertex ML Metadata")
    show.add_argument("--region", help="Vertex AI region, with --project")
    show.add_argument("--max-hops", type=int, help="Vertex only: how far from the artifact to look (default: all)")
    listing = sub.add_parser("list", help="the artifacts in the store")
    listing.add_argument("--root", default=DEFAULT_ROOT, help="the pipeline root (default: runs)")
    listing.add_argument("--kind", help="only this kind (dataset, checkpoints, exported_model, metrics, params, files)")
    listing.add_argument("--json", action="store_true", help="JSON rows")
    rebuild = sub.add_parser("rebuild", help="re-index every manifest under ROOT")
    rebuild.add_argument("root", metavar="ROOT")
    for command in (show, listing, rebuild):  # `maxpipe lineage ... --debug`: the top-level CLI's flag, accepted here
        command.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser


def _show_view(args: argparse.Namespace) -> LineageView:
    """The view `show` renders: from Vertex for gs:// with --project/--region, else from the local store."""
    if args.project or args.region:
        if not (args.project and args.region and args.ref.startswith("gs://")):
            raise UserError("reading lineage from Vertex ML Metadata needs a gs:// REF, --project and --region")
        return vertex_view(args.ref, args.project, args.region, max_hops=args.max_hops)
    path = store_path(args.root)
    local_dir = "://" not in args.ref and load_manifest(args.ref) is not None
    if not path.exists() and not local_dir:
        hint = " (or pass --project and --region to read Vertex ML Metadata)" if args.ref.startswith("gs://") else ""
        raise UserError(f"no lineage store at {path}: run a pipeline with pipeline.root={args.root}, "
                        f"or index existing outputs with `maxpipe lineage rebuild {args.root}`{hint}")
    # An artifact dir given by path is (re)indexed with its inputs first, so outputs of single steps show too.
    with LineageStore(path if path.exists() else ":memory:") as store:
        if local_dir:
            store.index_upstream(args.ref)
        try:
            return store.view(args.ref)
        except UserError as err:
            if args.ref.startswith("gs://"):
                raise UserError(f"{err}; for a Vertex run pass --project and --region") from None
            raise


def _open_store(root: str) -> LineageStore:
    path = store_path(root)
    if not path.exists():
        raise UserError(f"no lineage store at {path}: run a pipeline with pipeline.root={root}, "
                        f"or index existing outputs with `maxpipe lineage rebuild {root}`")
    return LineageStore(path)


def _emit(text: str, output: str | None) -> None:
    if output is None:
        print(text.rstrip("\n"))
        return
    try:
        Path(output).write_text(text if text.endswith("\n") else text + "\n")
    except OSError as err:
        raise UserError(f"cannot write {output}: {err.strerror}") from None
    print(f"wrote {output}")


# ---- Vertex ML Metadata ------------------------------------------------------------------------


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
    config = _execution_config(execution, step)
    stats = {k: v for k, v in metadata.items() if k not in IDENTITY_KEYS}
    return Artifact(
        kind=str(metadata.get("kind") or artifact.schema_title.removeprefix("system.") or "artifact"),
        version=str(metadata.get("version") or artifact.name.rsplit("/", 1)[-1]),
        uri=artifact.uri, step=step, created=_iso(artifact.create_time),
        code_version=metadata.get("code_version"), config_summary=config_summary(config),
        stats=key_stats(stats), config=config, key=artifact.name,
    )


def _execution_config(execution: Any, step: str | None) -> dict[str, Any]:
    """The step's part of the config a Vertex execution ran with (its `config` input parameter), if recorded."""
    if execution is None:
        return {}
    metadata = _struct(execution)
    raw = metadata.get("input:config", metadata.get("config"))
    try:
        config = raw if isinstance(raw, dict) else json.loads(raw or "{}")
    except ValueError:
        return {}
    sections = STEP_SECTIONS.get(step or "")
    return {k: v for k, v in config.items() if k in sections} if sections else config


def _struct(message: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(type(message).pb(message).metadata)


def _plain(value: Any) -> Any:
    """Struct numbers are doubles: whole ones back to ints."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _iso(timestamp: Any) -> str | None:
    return timestamp.isoformat(timespec="seconds") if timestamp else None
