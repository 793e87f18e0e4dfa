"""Run the whole DAG on this machine with `kfp.local` (each step a subprocess of this environment)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from components.kfp_support import ERROR_PREFIX
from configs import Config, UserError
from contract.manifest import require_manifest
from pipelines.dag import build_pipeline
from pipelines.lineage_store import LineageStore, store_path
from trainer.train.goodput import line_of

Log = Callable[[str], None]
# Chatter of Beam's worker processes (apitools is only needed for Dataflow), hidden unless --debug.
# The SDK harness workers run as __main__ and log their start at INFO before they read the options.
NOISE = ("apitools not found", "Logging handler created", "INFO:apache_beam.", "INFO:__main__:",
         "WARNING:__main__:No semi_persistent_directory")


@contextlib.contextmanager
def filtered_stderr(noise: tuple[str, ...] = NOISE) -> Iterator[None]:
    """Drop lines containing any of `noise` from what this process and its children write to stderr.

    Beam's worker processes inherit the file descriptor, so sys.stderr alone cannot be swapped.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    copy = os.dup(saved)  # the pump's own, taken before `saved` can be closed

    def pump() -> None:
        with os.fdopen(read, "rb") as pipe, os.fdopen(copy, "wb", buffering=0) as out:
            for line in pipe:
                if not any(n.encode() in line for n in noise):
                    out.write(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        thread.join(timeout=5)  # until the pipe's last writer (a lingering worker) has gone


def run_local(cfg: Config, verbose: bool = False, log: Log = print) -> dict[str, Any]:
    """Run prep -> [ingest] -> train -> export -> eval under kfp.local; returns each output's manifest."""
    from kfp import local

    preflight(cfg)
    root = Path(cfg.pipeline.root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    # Steps run in other processes (and directories): give them absolute paths.
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"root": str(root)})})
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    pipeline = build_pipeline(cfg, local=True)
    # Locally every step runs in this environment: the cloud images and resources do not apply.
    warnings.filterwarnings("ignore", message=".*non-Python base image", category=RuntimeWarning)
    warnings.filterwarnings("ignore", message=".*have no effect in the current local runner", category=UserWarning)
    start = time.perf_counter()
    with _step_logs(verbose) as errors:
        try:
            outputs = pipeline().outputs
        except RuntimeError as err:
            raise UserError(errors[-1] if errors else f"the pipeline failed: {err}") from None
    manifests = {name: require_manifest(art.path) for name, art in outputs.items() if name != "metrics"}
    paths = {name: art.path for name, art in outputs.items()}
    run_name = Path(paths["metrics"]).relative_to(root).parts[0]  # kfp.local's {pipeline}-{timestamp} folder
    with LineageStore(store_path(root)) as lineage:
        lineage.record_run(run_name, [paths[name] for name in manifests])
    return {"seconds": time.perf_counter() - start, "manifests": manifests, "paths": paths, "run": run_name, "root": str(root)}


def preflight(cfg: Config) -> None:
    """Checks that take a second and would otherwise fail minutes into the run."""
    from data_prep import resolve_inputs
    from components.steps import tokenizer_source

    resolve_inputs(cfg.data.input)
    tokenizer = tokenizer_source(cfg)
    key = "data.tokenizer" if cfg.data.tokenizer else "pipeline.hf_checkpoint"
    if tokenizer and not Path(tokenizer).exists():
        raise UserError(f"{key}: {tokenizer} does not exist")
    if tokenizer and Path(tokenizer).is_dir():
        from data_prep.tokenizer import HF_FILE, SP_FILE

        if not any((Path(tokenizer) / name).is_file() for name in (HF_FILE, SP_FILE)):
            raise UserError(f"{key}: {tokenizer} holds no tokenizer ({HF_FILE} or {SP_FILE}); "
                            "give one with data.tokenizer=PATH")
    if cfg.pipeline.hf_checkpoint:
        from trainer.hf.config import check_hf_config, read_hf_config

        check_hf_config(read_hf_config(cfg.pipeline.hf_checkpoint), cfg.model)


def summary(result: dict[str, Any]) -> str:
    """A short report: where each artifact is, its version, losses, the training's goodput, perplexity and a sample."""
    m, paths = result["manifests"], result["paths"]
    train, ev = m["checkpoints"]["stats"], m["report"]["stats"]
    tokens = m["dataset"]["stats"]["tokens"]
    lines = [f"maxpipe run {result['run']} finished in {result['seconds'] / 60:.1f} min", ""]
    for name, what in (("dataset", "ArrayRecord shards"), ("checkpoints", "training checkpoints"),
                       ("model", "exported model (Orbax params + hf/)"), ("report", "evaluation")):
        lines.append(f"  {name:<12} {m[name]['version']}  {paths[name]}  ({what})")
    lines += [
        "",
        f"  data        {tokens['train']:,} train tokens, {tokens['val']:,} validation tokens",
        f"  train loss  {train['final_loss']:.4f} (mean of last 10 steps {train['mean_loss_last_10']:.4f}) "
        f"after {train['steps']} steps",
        *([f"  train time  {line_of(train)}"] if "goodput" in train else []),
        f"  val loss    {ev['val_loss']:.4f}   perplexity {ev['val_perplexity']:.2f}",
        f"  sample      {ev['prompt']!r} -> {ev['sample']!r}",
        "",
        f"  lineage     maxpipe lineage show {m['report']['version']} --root {result['root']}",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def _step_logs(verbose: bool) -> Iterator[list[str]]:
    """Show the steps' own output, without the KFP executor's JSON dumps unless verbose; collect error lines."""
    errors: list[str] = []
    real = sys.stdout
    sink = _Filter(real, errors, verbose)
    sys.stdout = sink
    try:
        yield errors
    finally:
        sink.flush()
        sys.stdout = real


class _Filter(io.TextIOBase):
    def __init__(self, out: Any, errors: list[str], verbose: bool):
        self.out, self.error_lines, self.verbose = out, errors, verbose
        self.buffer, self.dump_end = "", None  # dump_end: the line that closes the executor_input JSON
        self.in_outputs = False  # inside kfp.local's listing of a task's output artifacts (the summary has them)

    def write(self, text: str) -> int:
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self._line(self.buffer)
            self.buffer = ""
        self.out.flush()

    def _line(self, line: str) -> None:
        stripped = line.strip()
        if stripped.startswith(ERROR_PREFIX):
            self.error_lines.append(stripped.removeprefix(ERROR_PREFIX))
        if not self.verbose:
            if "Got executor_input:" in line:
                self.dump_end = ""
                return
            if self.dump_end is not None:
                if stripped == "{" and not self.dump_end:
                    self.dump_end = line.replace("{", "}").rstrip()
                elif line.rstrip() == self.dump_end:
                    self.dump_end = None
                return
            if self.in_outputs:
                if not stripped.startswith("-----"):
                    return
                self.in_outputs = False
            if " - INFO - Task " in line and stripped.endswith("outputs:"):
                self.in_outputs = True
                return
            if stripped.startswith("[KFP Executor") or not stripped or any(n in line for n in NOISE):
                return
        self.out.write(line + "\n")
