"""The pipeline's steps: what each one runs, the config fields that version its output, and `execute`.

Each `plan_*` function names a step's output without doing any work: its version hashes the config
fields the step declares (and only those reach its work), its inputs' versions and its code (the
modules its work function runs, contract/versions.py). `execute` holds the output directory's
lease (contract/lease.py), then reuses a complete output of this version (a cache hit) or runs
the work and publishes the manifest. Pipelines write into a content-addressed store,
`{store}/{step}/{version}`, so a rerun on any runner finds finished work; the CLI's single steps
write where the user says.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from configs import Config, TrainConfig, TrainSettings, UserError
from contract import lease, versions
from contract.manifest import (
    MANIFEST, check_output, clear_partial, mounted_url, publish, read_manifest, reference, require_manifest,
)

Log = Callable[[str], None]

# Fields of TrainConfig that change a training's result: not its run settings (TrainSettings), and not
# continue_from, which the pipeline resolves into the init input (versioned as that input).
TRAIN_FIELDS = sorted(set(TrainConfig.model_fields) - set(TrainSettings.model_fields) - {"continue_from"})


@dataclass(frozen=True)
class Step:
    """A step's identity and its work: `work(out_dir) -> stats`, a library function with its arguments bound."""

    name: str
    kind: str
    config: dict[str, Any]  # the fields that version the output: the work gets these and no other config
    inputs: list[dict[str, Any]]  # {kind, version, uri} of each input: their versions version the output
    work: functools.partial  # a library function with every argument but the output directory bound
    out_arg: str = "out_dir"  # the name under which `work` takes the output directory
    settings: dict[str, Any] = field(default_factory=dict)  # run settings the work gets that do not version it
    keep_partial: bool = False  # training resumes from the checkpoints an interrupted attempt left
    lease_timeout: float = 120.0

    @property
    def code(self) -> str:
        """The hash of the modules the work function runs."""
        return versions.code_version(self.work.func.__module__)

    @property
    def version(self) -> str:
        return versions.version_of(self.name, self.config, [i["version"] for i in self.inputs], self.code)


def plan_prep(cfg: Config, log: Log = print) -> Step:
    """Tokenize and pack the corpus into ArrayRecord shards (a Dataset artifact)."""
    from data_prep import fingerprint, prepare, resolve_inputs

    data = cfg.data.model_copy(update={"tokenizer": tokenizer_source(cfg)})
    data = versions.only(data, set(data.model_fields) - {"beam_args"})  # where Beam runs is not what it writes
    files = resolve_inputs(data.input)
    inputs = [{"kind": "files", "version": fingerprint(files), "uri": ",".join(data.input)}]
    beam_args = cfg.data.beam_args
    work = functools.partial(prepare, cfg=data, vocab_size=cfg.model.vocab_size, log=log, beam_args=beam_args)
    return Step("prep", "dataset", {"data": data, "vocab_size": cfg.model.vocab_size}, inputs, work,
                settings={"beam_args": beam_args}, lease_timeout=cfg.pipeline.lease_timeout)


def plan_ingest(cfg: Config, hf_dir: str | Path, log: Log = print) -> Step:
    """Convert a HF checkpoint (safetensors; pickle only if allowed) into our Orbax params (a Model artifact)."""
    from trainer.hf.ingest import ingest

    allow_pickle = cfg.pipeline.hf_allow_pickle
    uri = str(hf_dir) if "://" in str(hf_dir) else str(Path(hf_dir).absolute())
    inputs = [{"kind": "hf_checkpoint", "version": _hf_fingerprint(hf_dir, allow_pickle), "uri": uri}]
    work = functools.partial(ingest, hf_dir=hf_dir, cfg=cfg.model, log=log, allow_pickle=allow_pickle)
    return Step("ingest", "params", {"model": cfg.model, "allow_pickle": allow_pickle}, inputs, work,
                lease_timeout=cfg.pipeline.lease_timeout)


def plan_train(cfg: Config, dataset_dir: str | Path, init_dir: str | Path | None = None, log: Log = print) -> Step:
    """Train on the dataset, from random init or ingested params (a Model artifact of full checkpoints).

    Its goodput counts from this process's start: the CLI's, a KFP task's or a custom job host's. It sets the
    platform's default XLA flags (trainer/train/xla_flags.py), which must come before JAX's backend starts.
    """
    from trainer.train import xla_flags
    from trainer.train.goodput import process_start
    from trainer.train.loop import train

    log(xla_flags.apply())

    train_cfg = versions.only(cfg.train, TRAIN_FIELDS)
    settings = TrainSettings(**cfg.train.model_dump(include=set(TrainSettings.model_fields)))
    inputs = [reference(dataset_dir)] + ([reference(init_dir)] if init_dir else [])
    work = functools.partial(train, model_cfg=cfg.model, train_cfg=train_cfg, settings=settings,
                             dataset_dir=dataset_dir, init_params_dir=init_dir, log=log, started=process_start())
    return Step("train", "checkpoints", {"model": cfg.model, "train": train_cfg}, inputs, work, out_arg="run_dir",
                settings={"train": settings}, keep_partial=True, lease_timeout=cfg.pipeline.lease_timeout)


def plan_export(cfg: Config, train_dir: str | Path, dataset_dir: str | Path, log: Log = print) -> Step:
    """Param-only Orbax checkpoint and a HF directory from the last training checkpoint (a Model artifact)."""
    from trainer.hf.export import export

    exp = cfg.export
    work = functools.partial(
        export, train_dir=train_dir, model_cfg=cfg.model, dtype=exp.dtype or cfg.model.param_dtype,
        unscanned=exp.unscanned, max_shard_bytes=exp.max_shard_bytes, tokenizer_dir=Path(dataset_dir) / "tokenizer",
        log=log,
    )
    inputs = [reference(train_dir), reference(dataset_dir)]
    return Step("export", "exported_model", {"model": cfg.model, "export": exp}, inputs, work,
                lease_timeout=cfg.pipeline.lease_timeout)


def plan_eval(cfg: Config, model_dir: str | Path, dataset_dir: str | Path, log: Log = print) -> Step:
    """Validation loss, perplexity, samples and task scores of an exported model, and a report (a metrics artifact)."""
    from trainer.eval.run import run_eval

    inputs = [reference(model_dir), reference(dataset_dir)]
    if cfg.eval.tasks:  # a changed task file is a new evaluation
        from data_prep import fingerprint

        missing = [t for t in cfg.eval.tasks if not Path(t).is_file()]
        if missing:
            raise UserError(f"eval.tasks: no such file {missing[0]}")
        inputs.append({"kind": "files", "version": fingerprint(cfg.eval.tasks), "uri": ",".join(cfg.eval.tasks)})
    work = functools.partial(run_eval, model_dir=model_dir, model_cfg=cfg.model, eval_cfg=cfg.eval,
                             dataset_dir=dataset_dir, training_metrics=_training_metrics(model_dir), log=log)
    return Step("eval", "metrics", {"model": cfg.model, "eval": cfg.eval}, inputs, work,
                lease_timeout=cfg.pipeline.lease_timeout)


@contextlib.contextmanager
def claimed(step: Step, out: Path, log: Log = print) -> Iterator[tuple[dict[str, Any] | None, lease.Lease | None]]:
    """Hold the lease on `out` for `step`'s version; yields (its manifest, None) if it is (or becomes) complete,
    else (None, the lease).

    While another run holds the lease this waits for it (a cache hit when it finishes) or takes over
    a lease whose holder died. With the lease held, what an unfinished attempt left is cleared,
    unless the step resumes from it.
    """
    what = f"{step.name} {step.version}"
    with lease.held(mounted_url(out), what, lambda: check_output(out, step.version), timeout=step.lease_timeout,
                    log=log) as (done, held):
        if held is not None and not step.keep_partial:
            clear_partial(out, keep=lease.LEASE_DIR)
        yield done, held


def execute(step: Step, out_dir: str | Path, log: Log = print, primary: bool = True, leased: bool = True) -> dict[str, Any]:
    """Run a step into out_dir and publish its manifest, or return the manifest already there (cache hit).

    In a multi-host job every process does the work, only the `primary` one publishes, and the
    hosts run without the lease (`leased=False`): the launcher holds it while it waits for them.
    """
    if "://" in str(out_dir):
        # The manifest layer works on local and mounted paths (/gcs/... on Vertex).
        raise UserError(f"output {out_dir}: give a local or mounted path (e.g. /gcs/BUCKET/...), not a URL")
    out = Path(out_dir)
    if not leased:
        done = check_output(out, step.version)
        out.mkdir(parents=True, exist_ok=True)
        return done if done is not None else _run(step, out, log, primary, None)
    with claimed(step, out, log) as (done, held):
        if done is not None:
            log(f"[{step.name}] cache hit: version {step.version} is complete at {out}")
            return done
        return _run(step, out, log, primary, held)


def _run(step: Step, out: Path, log: Log, primary: bool, held: lease.Lease | None) -> dict[str, Any]:
    version = step.version
    log(f"[{step.name}] version {version} -> {out}")
    start = time.perf_counter()
    stats = step.work(**{step.out_arg: out})
    stats["seconds"] = round(time.perf_counter() - start, 2)
    if not primary:
        return {"version": version, "stats": stats}
    if held is not None:
        held.check()  # a run that was silent past the lease timeout has been replaced: it must not publish
    manifest = publish(
        out, kind=step.kind, step=step.name, version=version, code=step.code,
        config={k: versions.plain(v) for k, v in step.config.items()},
        settings={k: versions.plain(v) for k, v in step.settings.items()}, inputs=step.inputs, stats=stats,
    )
    log(f"[{step.name}] published version {version} ({stats['seconds']:.1f}s)")
    return manifest


def store_dir(store: str | Path, step: Step) -> Path:
    """Where a pipeline keeps a step's output: one directory per step and version."""
    return Path(store) / step.name / step.version


def prep(cfg: Config, out_dir: str | Path, log: Log = print) -> dict[str, Any]:
    """`plan_prep` executed into out_dir."""
    return execute(plan_prep(cfg, log), out_dir, log)


def ingest(cfg: Config, hf_dir: str | Path, out_dir: str | Path, log: Log = print) -> dict[str, Any]:
    """`plan_ingest` executed into out_dir."""
    return execute(plan_ingest(cfg, hf_dir, log), out_dir, log)


def train(
    cfg: Config, dataset_dir: str | Path, out_dir: str | Path, init_dir: str | Path | None = None, log: Log = print
) -> dict[str, Any]:
    """`plan_train` executed into out_dir (resuming from its checkpoints if an earlier attempt left some)."""
    return execute(plan_train(cfg, dataset_dir, init_dir, log), out_dir, log)


def export(cfg: Config, train_dir: str | Path, dataset_dir: str | Path, out_dir: str | Path, log: Log = print) -> dict[str, Any]:
    """`plan_export` executed into out_dir."""
    return execute(plan_export(cfg, train_dir, dataset_dir, log), out_dir, log)


def evaluate(cfg: Config, model_dir: str | Path, dataset_dir: str | Path, out_dir: str | Path, log: Log = print) -> dict[str, Any]:
    """`plan_eval` executed into out_dir."""
    return execute(plan_eval(cfg, model_dir, dataset_dir, log), out_dir, log)


def latest_export(store: str | Path, cfg: Config, dataset_dir: str | Path) -> Path | None:
    """The newest complete export in the store of this model config that was trained on another dataset.

    Scheduled retraining continues from it: new data trains on from the last model, while a rerun
    on unchanged data picks the same starting point as before, so its train step is a cache hit.
    """
    dataset = require_manifest(dataset_dir)["version"]
    model = versions.plain(cfg.model)
    candidates = []
    for path in (Path(store) / "export").glob(f"*/{MANIFEST}"):
        export = read_manifest(path.parent)
        trained = read_manifest(export["inputs"][0]["uri"])
        if export["config"]["model"] == model and trained and trained["inputs"][0]["version"] != dataset:
            candidates.append((export["created"], export["version"], path.parent))
    return max(candidates)[2] if candidates else None


def _training_metrics(model_dir: str | Path) -> Path | None:
    """The metrics.jsonl of the training run an export came from, if the export has one upstream."""
    for ref in require_manifest(model_dir)["inputs"]:
        if ref["kind"] == "checkpoints" and (Path(ref["uri"]) / "metrics.jsonl").is_file():
            return Path(ref["uri"]) / "metrics.jsonl"
    return None


def tokenizer_source(cfg: Config) -> str:
    """The configured tokenizer; a run that starts from a HF checkpoint uses that checkpoint's tokenizer."""
    return cfg.data.tokenizer or cfg.pipeline.hf_checkpoint


def _hf_fingerprint(hf_dir: str | Path, pickle: bool = False) -> str:
    """The config and each weight file's name and size: cheap, and changes whenever the checkpoint does."""
    import fnmatch

    import fsspec

    fs, root = fsspec.core.url_to_fs(str(hf_dir))  # a local directory or any fsspec URL (gs://...)
    patterns = ["*.safetensors", "*.json"] + (["*.bin", "*.pt"] if pickle else [])
    entries = fs.ls(root, detail=True) if fs.isdir(root) else []
    names = [(e["name"].rsplit("/", 1)[-1], e["size"]) for e in entries if e["type"] == "file"]
    files = sorted((name, size) for name, size in names if any(fnmatch.fnmatch(name, p) for p in patterns))
    config = f"{root.rstrip('/')}/config.json"
    text = fs.cat_file(config).decode() if fs.isfile(config) else None
    key = json.dumps({"config": text, "files": files}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]
