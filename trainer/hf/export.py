"""Export: a training run's newest checkpoint as a param-only Orbax checkpoint and a HF model directory.

`export_hf` writes any param tree as HF safetensors, with its config.json and the prep step's tokenizer.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from configs import ModelConfig, UserError
from trainer.train.checkpoint import latest_stored_params
from trainer.hf.config import check_exportable, hf_config_from_model
from trainer.hf.tensor_spec import hf_names
from trainer.hf.tensors import tensor_specs
from trainer.model.decoder import param_count
from trainer.params.reader import PARAMS_DIR, ReadOnce, abstract_params, check_shapes
from trainer.params.writer import lazy_copies, save_lazy_params
from trainer.hf.safetensors_io import Entry, write_shards
from trainer.hf.tokenizer import FILES as TOKENIZER_FILES
from trainer.hf.tokenizer import SPECIAL_TOKENS

Log = Callable[[str], None]

HF_DIR = "hf"  # the HF directory in an export's output, beside the param checkpoint


def export(train_dir: str | Path, out_dir: str | Path, model_cfg: ModelConfig, *, dtype: str, unscanned: bool,
           max_shard_bytes: int, tokenizer_dir: str | Path | None, log: Log = print) -> dict[str, Any]:
    """Write the newest checkpoint of a training run as out_dir/params (Orbax, `dtype`, unscanned if asked) and
    out_dir/hf (HF safetensors in shards of at most `max_shard_bytes`, with the tokenizer when one is given).

    Each parameter is read from the checkpoint once, as it is written: memory stays well below the model's.
    Returns the export's stats.
    """
    out = Path(out_dir)
    step, stored = latest_stored_params(train_dir, abstract_params(model_cfg))
    save_lazy_params(out, lazy_copies(stored, dtype, unscanned=unscanned), log=log)
    hf_stats = export_hf(stored, model_cfg, tokenizer_dir, out / HF_DIR, log=log, dtype=dtype,
                         max_shard_bytes=max_shard_bytes)
    log(f"exported step {step}: {out / PARAMS_DIR} ({dtype}, {'unscanned' if unscanned else 'scanned'}) "
        f"and {out / HF_DIR}")
    return {"step": step, "params_dir": PARAMS_DIR, "dtype": dtype, "unscanned": unscanned, "hf_dir": HF_DIR,
            "hf": hf_stats}


def export_hf(params: Any, cfg: ModelConfig, tokenizer_dir: str | Path | None, out_dir: str | Path,
              log: Log = print, dtype: str = "", max_shard_bytes: int = 5_000_000_000) -> dict:
    """Write `params` as a HF directory of model.family's architecture (config, safetensors, tokenizer), replacing out_dir whole.

    Weights are written in `dtype` ("" = cfg.param_dtype), split into shards of at most `max_shard_bytes`
    with a `model.safetensors.index.json` when they do not fit in one file.
    """
    check_exportable(cfg)
    check_shapes(params, abstract_params(cfg))
    cfg = cfg.model_copy(update={"param_dtype": dtype}) if dtype else cfg
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        special = _export_tokenizer(Path(tokenizer_dir), tmp, cfg) if tokenizer_dir else {}
        dtype = np.dtype(cfg.param_dtype)
        bos, eos = special.get("bos_id"), special.get("eos_id")
        _write_json(tmp / "config.json", hf_config_from_model(cfg, bos, eos))
        _write_json(tmp / "generation_config.json", {
            "_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos,
        })
        size = write_shards(tmp, _export_entries(params, cfg), dtype, max_shard_bytes)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = param_count(params)
    log(f"export: {n:,} parameters ({cfg.param_dtype}, {size / 2**20:.1f} MiB) "
        f"{'and the tokenizer ' if special else ''}written to {out}")
    return {
        "parameters": n, "dtype": cfg.param_dtype, "bytes": size,
        "tokenizer": special.get("kind"), "files": sorted(p.name for p in out.iterdir()),
    }


def _export_entries(params: Any, cfg: ModelConfig) -> list[Entry]:
    """(HF name, HF shape, fetch) per tensor, in the order they are written; one parameter is on host at a time."""
    entries, specs = [], tensor_specs(cfg)
    parts: dict[tuple, list] = {}  # a HF tensor holding several parameters: its specs (see TensorSpec.join)
    for spec in specs:
        if spec.join is not None:
            parts.setdefault((spec.hf_name, spec.layers), []).append(spec)
    for spec in specs:
        group = parts.get((spec.hf_name, spec.layers), [spec]) if spec.join is not None else [spec]
        if group[0] is not spec:
            continue  # written with the first of its parts
        names = hf_names(spec, cfg)
        reads = [ReadOnce(_leaf(params, part.path), len(names)) for part in group]
        per_layer = cfg.num_experts if spec.experts else 1  # experts are written one tensor each, layer by layer
        for i, name in enumerate(names):
            layer = i // per_layer if spec.stacked else None
            expert = i % per_layer if spec.experts else None
            entries.append((name, spec.hf_shape, partial(_fetch, reads, layer, expert, spec.to_hf, spec.join)))
    return entries


def _leaf(params: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        params = params[key]
    return params


def _fetch(
    reads: list[ReadOnce], layer: int | None, expert: int | None, to_hf: Callable[[np.ndarray], np.ndarray],
    join: Callable[[list[np.ndarray]], np.ndarray] | None,
) -> np.ndarray:
    if join is not None:
        return join([once.read(layer, expert) for once in reads])
    return to_hf(reads[0].read(layer, expert))


def _export_tokenizer(tokenizer_dir: Path, dest: Path, cfg: ModelConfig) -> dict:
    """Copy the prep step's tokenizer into `dest` with a tokenizer_config.json; returns special_tokens.json."""
    src = tokenizer_dir / "tokenizer" if (tokenizer_dir / "tokenizer").is_dir() else tokenizer_dir
    special_path = src / SPECIAL_TOKENS
    if not special_path.is_file():
        raise UserError(f"no {SPECIAL_TOKENS} in {src}: expected the tokenizer directory written by prep")
    special = _read_json(special_path)
    kind = special.get("kind")
    if kind not in TOKENIZER_FILES:
        raise UserError(f"{special_path}: unknown tokenizer kind {kind!r} (expected {sorted(TOKENIZER_FILES)})")
    if not (src / TOKENIZER_FILES[kind]).is_file():
        raise UserError(f"no {TOKENIZER_FILES[kind]} in {src}")
    if special.get("vocab_size", 0) > cfg.vocab_size:
        raise UserError(
            f"tokenizer in {src} has {special['vocab_size']} tokens but model.vocab_size is {cfg.vocab_size}"
        )
    tok_config: dict[str, Any] = {
        "model_max_length": cfg.max_seq_len,
        "eos_token": special.get("eos_token"),
        "clean_up_tokenization_spaces": False,
    }
    if special.get("bos_token") is not None:
        tok_config["bos_token"] = special["bos_token"]
    file = TOKENIZER_FILES[kind]
    if kind == "hf":
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        if special.get("bos_id") is not None and special.get("prepend_bos"):
            _copy_adding_bos(src / file, dest / file, special["bos_token"])
        else:
            shutil.copy2(src / file, dest / file)
    else:
        shutil.copy2(src / file, dest / file)
        tok_config.update(
            tokenizer_class="LlamaTokenizer", add_bos_token=special.get("bos_id") is not None, add_eos_token=False,
        )
    _write_json(dest / "tokenizer_config.json", tok_config)
    return special


def _copy_adding_bos(src: Path, dest: Path, bos: str) -> None:
    """Copy a tokenizer.json whose encode() lacks the BOS that prep prepends, making it add BOS.

    transformers ignores add_bos_token when a tokenizer.json is present: only its post-processor counts.
    """
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(src))
    template = processors.TemplateProcessing(
        single=[bos, "$A"], pair=[bos, "$A", bos, "$B:1"], special_tokens=[(bos, tok.token_to_id(bos))],
    )
    tok.post_processor = processors.Sequence([tok.post_processor, template]) if tok.post_processor else template
    tok.save(str(dest))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err})") from None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _replace_dir(new: Path, out: Path) -> None:
    """Move a finished directory into place, replacing whatever was at `out`."""
    if not out.exists():
        new.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
