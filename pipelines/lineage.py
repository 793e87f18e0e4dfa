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
from pathlib import Path

from configs import UserError
from pipelines import lineage_queries as queries
from pipelines.lineage_graph import LineageView
from pipelines.lineage_render import FORMATS, list_json, list_text, render
from pipelines.lineage_storage import indexable_manifest
from pipelines.lineage_store import LineageStore, store_path
from pipelines.lineage_vertex import vertex_view

DEFAULT_ROOT = "runs"  # configs/base.yml: pipeline.root


def lineage_main(argv: list[str]) -> int:
    """Run `maxpipe lineage ...` (argv after `lineage`); errors are raised as one-line UserErrors."""
    args = _parser().parse_args(argv)
    if args.command == "show":
        text = render(_show_view(args), "json" if args.json else args.format)
        _emit(text, args.output)
    elif args.command == "list":
        with _open_store(args.root) as store:
            rows = queries.list_artifacts(store, args.kind)
            if args.kind and not rows:
                kinds = ", ".join(queries.kinds(store)) or "none"
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
    local_dir = "://" not in args.ref and indexable_manifest(args.ref) is not None
    if not path.exists() and not local_dir:
        hint = " (or pass --project and --region to read Vertex ML Metadata)" if args.ref.startswith("gs://") else ""
        raise UserError(f"no lineage store at {path}: run a pipeline with pipeline.root={args.root}, "
                        f"or index existing outputs with `maxpipe lineage rebuild {args.root}`{hint}")
    # An artifact dir given by path is (re)indexed with its inputs first, so outputs of single steps show too.
    with LineageStore(path if path.exists() else ":memory:") as store:
        if local_dir:
            store.index_upstream(args.ref)
        try:
            return queries.view(store, args.ref)
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
