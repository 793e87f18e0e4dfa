"""The pipeline's steps as plain functions: version, cache check, work, manifest.

Each step takes the resolved config, its input artifact directories and its output directory, and
returns the output's manifest. A complete output of the same version is reused (a cache hit), on
any runner: the CLI's single steps, `kfp.local` and Vertex all come through here.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

from configs import Config
from components import artifacts

Log = Callable[[str], None]


def prep(cfg: Config, out_dir: str | Path, log: Log = print) -> dict[str, Any]:
    """Tokenize and pack the corpus into ArrayRecord shards (a Dataset artifact)."""
    from data_prep import fingerprint, prepare, resolve_inputs

    data = cfg.data.model_copy(update={"tokenizer": tokenizer_source(cfg)})
    files = resolve_inputs(data.input)
    inputs = [{"kind": "files", "version": fingerprint(files), "uri": ",".join(data.input)}]
    config = {"data": data.model_dump(exclude={"beam_args"}), "vocab_size": cfg.model.vocab_size}
    return _run_step(
        "prep", "dataset", out_dir, config, inputs, artifacts.code_version("data_prep"), log,
        lambda: prepare(data, cfg.model.vocab_size, out_dir, log=log),
    )


def ingest(cfg: Config, hf_dir: str | Path, out_dir: str | Path, log: Log = print) -> dict[str, Any]:
    """Convert a HF Llama safetensors checkpoint into our Orbax params (a Model artifact)."""
    from trainer import hf

    inputs = [{"kind": "hf_checkpoint", "version": _hf_fingerprint(hf_dir), "uri": str(Path(hf_dir).absolute())}]
    return _run_step(
        "ingest", "params", out_dir, {"model": cfg.model.model_dump()}, inputs, artifacts.code_version("trainer"), log,
        lambda: hf.ingest(hf_dir, out_dir, cfg.model, log=log),
    )


def train(
    cfg: Config, dataset_dir: str | Path, out_dir: str | Path, init_dir: str | Path | None = None, log: Log = print
) -> dict[str, Any]:
    """Train the model on the dataset, optionally from ingested params (a Model artifact of full checkpoints)."""
    from trainer.train import train as run_training

    inputs = [artifacts.reference(dataset_dir)] + ([artifacts.reference(init_dir)] if init_dir else [])
    config = {"model": cfg.model.model_dump(), "train": cfg.train.model_dump()}
    return _run_step(
        "train", "checkpoints", out_dir, config, inputs, artifacts.code_version("trainer"), log,
        lambda: run_training(cfg.model, cfg.train, dataset_dir, out_dir, init_params_dir=init_dir, log=log),
        keep_partial=True,
    )


def export(cfg: Config, train_dir: str | Path, dataset_dir: str | Path, out_dir: str | Path, log: Log = print) -> dict[str, Any]:
    """Param-only Orbax checkpoint and a HF directory from the last training checkpoint (a Model artifact)."""
    from trainer import checkpoint, hf

    def work() -> dict[str, Any]:
        step, params = checkpoint.latest_trained_params(train_dir, checkpoint.abstract_params(cfg.model))
        checkpoint.save_params(out_dir, params)
        hf_stats = hf.export_hf(params, cfg.model, Path(dataset_dir) / "tokenizer", Path(out_dir) / "hf", log=log)
        log(f"exported step {step}: {Path(out_dir) / checkpoint.PARAMS_DIR} and {Path(out_dir) / 'hf'}")
        return {"step": step, "params_dir": checkpoint.PARAMS_DIR, "hf_dir": "hf", "hf": hf_stats}

    inputs = [artifacts.reference(train_dir), artifacts.reference(dataset_dir)]
    return _run_step(
        "export", "exported_model", out_dir, {"model": cfg.model.model_dump()}, inputs,
        artifacts.code_version("trainer"), log, work,
    )


def evaluate(cfg: Config, model_dir: str | Path, dataset_dir: str | Path, out_dir: str | Path, log: Log = print) -> dict[str, Any]:
    """Validation loss, perplexity and a generated sample of an exported model (a metrics artifact)."""
    from trainer import checkpoint
    from trainer.evaluate import evaluate as run_eval

    def work() -> dict[str, Any]:
        params = checkpoint.load_params(model_dir, checkpoint.abstract_params(cfg.model))
        results = run_eval(params, cfg.model, cfg.eval, dataset_dir, log=log)
        (Path(out_dir) / "metrics.json").write_text(json.dumps(results, indent=2))
        return results

    inputs = [artifacts.reference(model_dir), artifacts.reference(dataset_dir)]
    return _run_step(
        "eval", "metrics", out_dir, {"eval": cfg.eval.model_dump()}, inputs, artifacts.code_version("trainer"), log, work,
    )


def tokenizer_source(cfg: Config) -> str:
    """The configured tokenizer; a run that starts from a HF checkpoint uses that checkpoint's tokenizer."""
    return cfg.data.tokenizer or cfg.pipeline.hf_checkpoint


def _run_step(
    step: str, kind: str, out_dir: str | Path, config: dict[str, Any], inputs: list[dict[str, Any]], code: str,
    log: Log, work: Callable[[], dict[str, Any]], keep_partial: bool = False,
) -> dict[str, Any]:
    version = artifacts.version_of(step, config, inputs, code)
    cached = artifacts.prepare_output(out_dir, version, keep_partial=keep_partial)
    if cached is not None:
        log(f"[{step}] cache hit: {out_dir} is complete at version {version}")
        return cached
    log(f"[{step}] version {version} -> {out_dir}")
    start = time.perf_counter()
    stats = work()
    stats["seconds"] = round(time.perf_counter() - start, 2)
    manifest = artifacts.publish(
        out_dir, kind=kind, step=step, version=version, code=code, config=config, inputs=inputs, stats=stats
    )
    log(f"[{step}] published version {version} ({stats['seconds']:.1f}s)")
    return manifest


def _hf_fingerprint(hf_dir: str | Path) -> str:
    """The config and each weight file's name and size: cheap, and changes whenever the checkpoint does."""
    from trainer.hf import read_hf_config

    files = sorted((p.name, p.stat().st_size) for p in Path(hf_dir).glob("*.safetensors"))
    key = json.dumps({"config": read_hf_config(hf_dir), "files": files}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]
