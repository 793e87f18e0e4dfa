"""`maxpipe submit` and `maxpipe schedule`: run the compiled pipeline on Vertex AI or Kubeflow Pipelines.

    maxpipe submit [PRESET] [key=value ...] --project P --region R --pipeline-root gs://B/PATH
                   [--display-name N] [--service-account SA] [--network NET] [--labels k=v ...]
                   [--no-cache] [--wait] [--api-endpoint URL]
                   [--target kfp --host URL [--namespace NS] [--experiment E]]
    maxpipe schedule create [PRESET] [key=value ...] --cron "TZ=Europe/Paris 0 3 * * 1" [submit options]
                            [--max-concurrent-runs N]
    maxpipe schedule list                     --project P --region R  (or --target kfp --host URL)
    maxpipe schedule pause|resume|delete NAME --project P --region R  (NAME: display name, id or resource name)

Vertex AI runs and schedules are pipelines/vertex.py's, Kubeflow's pipelines/kfp_target.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from cloud.vertex_api import one_line
from configs import UserError, parse_override
from pipelines import kfp_target, vertex
from pipelines.model_source import resolve_config


def remote_main(argv: Sequence[str]) -> int:
    """`maxpipe submit ...` and `maxpipe schedule create|list|pause|resume|delete ...`.

    Errors are printed as one `error: ...` line (exit status 1); with `--debug` they are raised.
    """
    argv = list(argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return _remote_main(argv)
    except UserError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - one line without --debug, like the rest of the CLI
        if debug:
            raise
        print(f"error: {type(err).__name__}: {one_line(str(err))} (rerun with --debug for the traceback)",
              file=sys.stderr)
    return 1


def _remote_main(argv: list[str]) -> int:
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
        rows = kfp_target.kfp_schedule_list(**where) if kfp else vertex.schedule_list(**where)
        print(_table(rows))
        return 0
    action = command.split()[1]
    if kfp:
        getattr(kfp_target, f"kfp_schedule_{action}")(args.name, **where)
    else:
        getattr(vertex, f"schedule_{action}")(args.name, **where)
    return 0


def _submit_or_create(command: str, args: argparse.Namespace, kfp: bool, where: dict[str, Any]) -> int:
    from pipelines.dag import compile_pipeline  # KFP's DSL: loaded only to compile

    if not kfp and not args.pipeline_root:
        raise UserError("Vertex AI needs --pipeline-root gs://BUCKET/PATH (where runs write their artifacts)")
    if kfp and (args.network or args.labels):
        raise UserError("--network and --labels apply to Vertex AI only")
    preset, overrides = _preset_and_overrides(args.items)
    if args.pipeline_root and not any(parse_override(o)[0] == ["pipeline", "root"] for o in overrides):
        overrides.append(f"pipeline.root={args.pipeline_root}")  # the steps write under the run's root
    cfg = resolve_config(preset, overrides)  # without model=NAME, pipeline.hf_checkpoint's model
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
            vertex.submit(spec, wait=args.wait, **common)
        else:
            vertex.schedule_create(spec, cron=args.cron, max_concurrent_runs=args.max_concurrent_runs, **common)
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
