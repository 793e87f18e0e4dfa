"""`maxpipe`: run the pipeline locally, compile it, or run one step.

    maxpipe run [PRESET] [key=value ...]              the whole DAG under kfp.local
    maxpipe compile [PRESET] [key=value ...] -o FILE  the KFP pipeline spec for Vertex AI / Kubeflow
    maxpipe prep    [PRESET] [key=value ...] output=DIR
    maxpipe ingest  [PRESET] [key=value ...] src=HF_DIR output=DIR
    maxpipe train   [PRESET] [key=value ...] dataset=DIR output=DIR [init=PARAMS_DIR]
    maxpipe train   [PRESET] [key=value ...] [dataset=DIR] --compile-only [--topology v5p-64]
    maxpipe export  [PRESET] [key=value ...] src=TRAIN_DIR dataset=DIR output=DIR
    maxpipe eval    [PRESET] [key=value ...] src=EXPORT_DIR dataset=DIR output=DIR
    maxpipe submit  [PRESET] [key=value ...] --project P --region R --pipeline-root gs://... [...]
    maxpipe schedule create|list|pause|resume|delete ...
    maxpipe lineage show REF | list | rebuild ROOT
    maxpipe data inspect DATASET_DIR

Without model=NAME (or a preset given by name that names a model), the model config is the one of the artifact
a step starts from (init=, src=), else the HF checkpoint's (ingest's src=, pipeline.hf_checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Sequence

from configs import Config, UserError, available
from pipelines.model_source import resolve_config

# The artifact directories each single step reads and writes (`dst` is an alias of `output`).
STEP_PATHS = {
    "prep": ("output",),
    "ingest": ("src", "output"),
    "train": ("dataset", "output", "init"),
    "export": ("src", "dataset", "output"),
    "eval": ("src", "dataset", "output"),
}
OPTIONAL_PATHS = {"init"}


# Commands with options of their own, handed their arguments whole.
DELEGATED = ("submit", "schedule", "lineage", "data")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `maxpipe` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if argv[:1] and argv[0] in ("submit", "schedule"):
        from pipelines.remote_cli import remote_main

        return remote_main(argv)  # prints its own one-line errors
    debug = "--debug" in argv
    try:
        if argv[:1] == ["lineage"]:
            from pipelines.lineage import lineage_main

            return lineage_main([a for a in argv[1:] if a != "--debug"])
        if argv[:1] == ["data"]:
            return _data(argv[1:])
        # Flags may sit anywhere among the key=value items (argparse stops at the first one).
        flags = [i for i, a in enumerate(argv) if a == "--compile-only" or a.startswith("--topology")]
        flags += [i + 1 for i in flags if argv[i] == "--topology" and i + 1 < len(argv)]
        moved = [argv[i] for i in sorted(flags)]
        args = _parser().parse_args([a for i, a in enumerate(argv) if i not in flags] + moved)
        if getattr(args, "topology", None):
            # Compiling for a TPU slice needs no local accelerator: keep JAX (and libtpu) off any this host has.
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return _dispatch(args)
    except UserError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - anything unexpected is still one line without --debug
        if debug:
            raise
        print(f"error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", file=sys.stderr)
    return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maxpipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks and the KFP executor's full logs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in DELEGATED:
        cmd = sub.add_parser(name, help=f"maxpipe {name} (see maxpipe {name} --help)", add_help=False)
        cmd.add_argument("rest", nargs=argparse.REMAINDER)
    for name in ("run", "compile", *STEP_PATHS):
        cmd = sub.add_parser(name, help=f"maxpipe {name}")
        cmd.add_argument("items", nargs="*", metavar="[PRESET] key=value",
                         help=f"a preset ({', '.join(available('presets'))}) and config overrides")
        cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
        if name == "compile":
            cmd.add_argument("-o", "--output", default="pipeline.yaml", help="where to write the pipeline spec")
        if name == "train":
            cmd.add_argument("--compile-only", action="store_true",
                             help="compile the train step for the mesh and report per-device memory; train nothing")
            cmd.add_argument("--topology", metavar="TPU_TYPE", default="",
                             help="with --compile-only: compile for this TPU slice (v4-8, v5e-16, v5p-64, v6e-256, ...) "
                                  "on this machine, train.dcn_mesh slices of it; needs libtpu (pip install -e '.[tpu]')")
    return parser


def _data(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="maxpipe data", description="Look inside a prepared dataset.")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="statistics, document lengths and decoded samples of a dataset")
    inspect.add_argument("directory")
    inspect.add_argument("--samples", type=int, default=2, help="decoded validation sequences to show")
    args = parser.parse_args([a for a in argv if a != "--debug"])
    from data_prep.describe import describe_dataset

    print(describe_dataset(args.directory, samples=args.samples))
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    compile_only = getattr(args, "compile_only", False)
    if getattr(args, "topology", "") and not compile_only:
        raise UserError("--topology compiles for a TPU slice this machine does not have: add --compile-only")
    preset, overrides, paths = _split_items(args.items, STEP_PATHS.get(args.command, ()), required=not compile_only)
    start = paths.get("init" if args.command == "train" else "src")  # the input the step starts from
    if args.command == "ingest":
        cfg = resolve_config(preset, overrides, hf_dir=start)
    else:
        cfg = resolve_config(preset, overrides, artifact=start)
    if compile_only:
        fits = _compile_train(cfg, paths.get("dataset"), args.topology)
        return 0 if fits is not False else 1
    elif args.command == "run":
        from pipelines.local import run_local, summary

        print(summary(run_local(cfg, verbose=args.debug)))
    elif args.command == "compile":
        from pipelines.dag import compile_pipeline

        compile_pipeline(cfg, args.output)
        print(f"wrote {args.output}")
    else:
        from pipelines.local import filtered_stderr

        with contextlib.nullcontext() if args.debug or args.command != "prep" else filtered_stderr():
            manifest = _run_step(args.command, cfg, paths)
        print(f"{args.command}: {paths['output']} version {manifest['version']}")
    return 0


def _split_items(
    items: Sequence[str], path_keys: Sequence[str], required: bool = True,
) -> tuple[str | None, list[str], dict[str, str]]:
    """Separate the preset, the config overrides and the step's artifact paths."""
    preset, overrides, paths = None, [], {}
    for i, item in enumerate(items):
        key, sep, value = item.partition("=")
        key = "output" if key == "dst" else key
        if not sep and i == 0:
            preset = item
        elif key in path_keys:
            paths[key] = value
        else:
            overrides.append(item)
    missing = [k for k in path_keys if k not in paths and k not in OPTIONAL_PATHS]
    if missing and required:
        raise UserError(f"missing {', '.join(f'{k}=DIR' for k in missing)}")
    return preset, overrides, paths


def _compile_train(cfg: Config, dataset: str | None, topology: str) -> bool | None:
    """`maxpipe train --compile-only`: the step compiled for the mesh (of a TPU slice), on the dataset's sequences
    if given; whether it fits the devices' memory (None where that is unknown, on CPU)."""
    from trainer.train.loop import compile_only

    seq_len, documents = cfg.data.seq_len, cfg.data.packing == "documents"
    if dataset:
        from trainer.train.data import record_format

        fmt = record_format(dataset)
        seq_len, documents = fmt.seq_len or seq_len, fmt.packing == "documents"
    return compile_only(cfg.model, cfg.train, seq_len, documents=documents, topology=topology)["fits"]


def _run_step(command: str, cfg: Config, paths: dict[str, str]) -> dict[str, Any]:
    from components import steps

    if command == "prep":
        return steps.prep(cfg, paths["output"])
    if command == "ingest":
        return steps.ingest(cfg, paths["src"], paths["output"])
    if command == "train":
        return steps.train(cfg, paths["dataset"], paths["output"], paths.get("init"))
    if command == "export":
        return steps.export(cfg, paths["src"], paths["dataset"], paths["output"])
    return steps.evaluate(cfg, paths["src"], paths["dataset"], paths["output"])


if __name__ == "__main__":
    sys.exit(main())
