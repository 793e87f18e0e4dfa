"""The pipeline's steps as plain functions: version, cache check, work, manifest.

Each `plan_*` function names a step's output (its version, from the config fields that change it,
its inputs' versions and its code) without doing any work. `execute` then runs it into a directory,
or reuses that directory when it already holds this version complete (a cache hit). Pipelines
write into a content-addressed store, `{store}/{step}/{version}`, so a rerun on any runner finds
finished work; the CLI's single steps write where the user says.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from configs import Config, UserError
from contract import manifest as artifacts

Log = Callable[[str], None]


@dataclass(frozen=True)
class Step:
    """A step's identity and its work, `work(out_dir) -> stats`."""

    name: str
    kind: str
    config: dict[str, Any]
    inputs: list[dict[str, Any]]
    code: str
    work: Callable[[Path], dict[str, Any]]
    keep_partial: bool = False  # training resumes from the checkpoints an interrupted attempt left

    @property
    def version(self) -> str:
        return artifacts.version_of(self.name, self.config, self.inputs, self.code)


def plan_prep(cfg: Config, log: Log = print) -> Step:
    """Tokenize and pack the corpus into ArrayRecord shards (a Dataset artifact)."""
    from data_prep import fingerprint, resolve_inputs

    data = cfg.data.model_copy(update={"tokenizer": tokenizer_source(cfg)})
    files = resolve_inputs(data.input)
    inputs = [{"kind": "files", "version": fingerprint(files), "uri": ",".join(data.input)}]

    def work(out: Path) -> dict[str, Any]:
        from data_prep import prepare
        from data_prep.pipeline import is_direct, pipeline_options

        # Dataflow's workers cannot see this task's Cloud Storage mount: they write to gs:// itself.
        target = out if is_direct(pipeline_options(data.beam_args)) else artifacts.mounted_url(out)
        return prepare(data, cfg.model.vocab_size, target, log=log)

    config = {"data": data.model_dump(exclude={"beam_args"}), "vocab_size": cfg.model.vocab_size}
    return Step("prep", "dataset", config, inputs, artifacts.code_version("data_prep"), work)


def plan_ingest(cfg: Config, hf_dir: str | Path, log: Log = print) -> Step:
    """Convert a HF checkpoint (safetensors; pickle only if allowed) into our Orbax params (a Model artifact)."""
    allow_pickle = cfg.pipeline.hf_allow_pickle

    def work(out: Path) -> dict[str, Any]:
        from trainer import hf

        return hf.ingest(hf_dir, out, cfg.model, log=log, allow_pickle=allow_pickle)

    version = _hf_fingerprint(hf_dir, allow_pickle)
    uri = str(hf_dir) if "://" in str(hf_dir) else str(Path(hf_dir).absolute())
    inputs = [{"kind": "hf_checkpoint", "version": version, "uri": uri}]
    config = {"model": cfg.model.model_dump(), "allow_pickle": allow_pickle}
    return Step("ingest", "params", config, inputs, artifacts.code_version("trainer"), work)


def plan_train(cfg: Config, dataset_dir: str | Path, init_dir: str | Path | None = None, log: Log = print) -> Step:
    """Train on the dataset, from random init or ingested params (a Model artifact of full checkpoints)."""

    def work(out: Path) -> dict[str, Any]:
        from trainer.train import train

        return train(cfg.model, cfg.train, dataset_dir, out, init_params_dir=init_dir, log=log)

    inputs = [artifacts.reference(dataset_dir)] + ([artifacts.reference(init_dir)] if init_dir else [])
    config = {"model": cfg.model.model_dump(), "train": cfg.train.model_dump()}
    return Step("train", "checkpoints", config, inputs, artifacts.code_version("trainer"), work, keep_partial=True)


def plan_export(cfg: Config, train_dir: str | Path, dataset_dir: str | Path, log: Log = print) -> Step:
    """Param-only Orbax checkpoint and a HF directory from the last training checkpoint (a Model artifact)."""

    exp = cfg.export

    def work(out: Path) -> dict[str, Any]:
        from trainer import checkpoint, hf

        # Each parameter read from the checkpoint once, as it is written: memory stays well below the model's.
        step, stored = checkpoint.latest_stored_params(train_dir, checkpoint.abstract_params(cfg.model))
        dtype = exp.dtype or cfg.model.param_dtype
        copies = checkpoint.lazy_copies(stored, dtype, unscanned=exp.unscanned)
        checkpoint.save_lazy_params(out, copies)
        hf_stats = hf.export_hf(stored, cfg.model, Path(dataset_dir) / "tokenizer", out / "hf", log=log,
                                dtype=dtype, max_shard_bytes=exp.max_shard_bytes)
        log(f"exported step {step}: {out / checkpoint.PARAMS_DIR} ({dtype}, "
            f"{'unscanned' if exp.unscanned else 'scanned'}) and {out / 'hf'}")
        return {"step": step, "params_dir": checkpoint.PARAMS_DIR, "dtype": dtype, "unscanned": exp.unscanned,
                "hf_dir": "hf", "hf": hf_stats}

    inputs = [artifacts.reference(train_dir), artifacts.reference(dataset_dir)]
    config = {"model": cfg.model.model_dump(), "export": exp.model_dump()}
    return Step("export", "exported_model", config, inputs, artifacts.code_version("trainer"), work)


def plan_eval(cfg: Config, model_dir: str | Path, dataset_dir: str | Path, log: Log = print) -> Step:
    """Validation loss, perplexity, samples and task scores of an exported model, and a report (a metrics artifact)."""

    def work(out: Path) -> dict[str, Any]:
        from trainer import checkpoint
        from trainer.evaluate import evaluate
        from trainer.report import write_report

        params = checkpoint.load_params(model_dir, checkpoint.abstract_params(cfg.model))
        results = evaluate(params, cfg.model, cfg.eval, dataset_dir, log=log)
        (out / "metrics.json").write_text(json.dumps(results, indent=2))
        write_report(out, results, _training_metrics(model_dir))
        return results

    inputs = [artifacts.reference(model_dir), artifacts.reference(dataset_dir)]
    if cfg.eval.tasks:  # a changed task file is a new evaluation
        from data_prep import fingerprint

        missing = [t for t in cfg.eval.tasks if not Path(t).is_file()]
        if missing:
            raise UserError(f"eval.tasks: no such file {missing[0]}")
        inputs.append({"kind": "files", "version": fingerprint(cfg.eval.tasks), "uri": ",".join(cfg.eval.tasks)})
    return Step("eval", "metrics", {"eval": cfg.eval.model_dump()}, inputs, artifacts.code_version("trainer"), work)


def execute(step: Step, out_dir: str | Path, log: Log = print, primary: bool = True) -> dict[str, Any]:
    """Run a step into out_dir and publish its manifest, or return the manifest already there (cache hit).

    In a multi-host job every process does the work and only the `primary` one publishes.
    """
    if "://" in str(out_dir):
        # The manifest layer (components.artifacts) works on local and mounted paths (/gcs/... on Vertex).
        raise UserError(f"output {out_dir}: give a local or mounted path (e.g. /gcs/BUCKET/...), not a URL")
    out = Path(out_dir)
    version = step.version
    cached = artifacts.prepare_output(out, version, keep_partial=step.keep_partial or not primary)
    if cached is not None:
        log(f"[{step.name}] cache hit: version {version} is complete at {out}")
        return cached
    log(f"[{step.name}] version {version} -> {out}")
    start = time.perf_counter()
    stats = step.work(out)
    stats["seconds"] = round(time.perf_counter() - start, 2)
    if not primary:
        return {"version": version, "stats": stats}
    manifest = artifacts.publish(
        out, kind=step.kind, step=step.name, version=version, code=step.code, config=step.config,
        inputs=step.inputs, stats=stats,
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
    dataset = artifacts.require_manifest(dataset_dir)["version"]
    model = cfg.model.model_dump()
    candidates = []
    for path in (Path(store) / "export").glob(f"*/{artifacts.MANIFEST}"):
        export = json.loads(path.read_text())
        trained = artifacts.read_manifest(export["inputs"][0]["uri"])
        if export["config"]["model"] == model and trained and trained["inputs"][0]["version"] != dataset:
            candidates.append((export["created"], export["version"], path.parent))
    return max(candidates)[2] if candidates else None


def _training_metrics(model_dir: str | Path) -> Path | None:
    """The metrics.jsonl of the training run an export came from, if the export has one upstream."""
    for ref in artifacts.require_manifest(model_dir)["inputs"]:
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
