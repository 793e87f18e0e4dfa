"""The prep step: input files -> tokenizer + packed int32 ArrayRecord shards (train/val) + stats."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from configs import DataConfig, UserError
from contract.manifest import mounted_url
from contract.records import RecordFormat
from data_prep import mixture, storage
from data_prep import tokenizer as tokenizers_
from data_prep.sources import (
    DEAD_LETTER,
    fingerprint,
    read_documents,
    relative_names,
    resolve_inputs,
    resolve_sources,
)

if TYPE_CHECKING:
    from apache_beam.options.pipeline_options import PipelineOptions

__all__ = ["fingerprint", "prepare", "resolve_inputs"]

STAGING = ".prep-staging"  # everything is written here first and moved into place only once it all checks out


def prepare(
    cfg: DataConfig, vocab_size: int, out_dir: str | Path, log: Callable[[str], None] = print,
    beam_args: Sequence[str] = (),
) -> dict:
    """Tokenize and pack cfg.input into out_dir (shards + tokenizer/); returns JSON-serialisable stats.

    `beam_args` choose where Beam runs (DirectRunner here by default), not what it writes.
    """
    from data_prep import pipeline  # Beam is imported only when a pipeline runs

    start = time.time()
    options = pipeline.pipeline_options(list(beam_args))
    out_dir = beam_target(out_dir, options)
    remote = storage.is_url(out_dir)
    out = str(out_dir).rstrip("/") if remote else Path(out_dir)
    sources = resolve_sources(cfg.input)
    files = [f for f, _ in sources]
    size = sum(storage.size(f) for f in files)
    digest = fingerprint(files)
    log(f"[prep] {len(files):,} input files, {_mb(size)} (fingerprint {digest[:12]})")

    storage.makedirs(out)
    staging = storage.join(out, STAGING)
    storage.remove(staging)
    storage.makedirs(staging)
    try:
        with tempfile.TemporaryDirectory(prefix="maxpipe-prep-") as tmp:
            # Tokenizers load local files: for a URL destination the tokenizer is installed here and staged
            # next to the shards, where the Beam workers fetch it.
            tok_local = Path(tmp, "tokenizer") if remote else staging / "tokenizer"
            info, source = _tokenizer(cfg, vocab_size, files, tok_local, log)
            if remote:
                storage.upload_dir(tok_local, storage.join(staging, "tokenizer"))
            counters = _run_beam(sources, cfg, staging, remote, options, log)
            stats = _stats(cfg, staging, tok_local, info, source, sources, size, digest, counters)
            _check(stats, cfg, len(files), source, staging)
            storage.publish(staging, out, [s["name"] for s in stats["shards"]] + [DEAD_LETTER], ["tokenizer"])
    finally:
        storage.remove(staging)

    for shard in stats["shards"]:
        log(f"[prep] {shard['name']}: {shard['sequences']:,} sequences, {shard['tokens']:,} tokens, {_mb(shard['bytes'])}")
    tokens, seconds = sum(stats["tokens"].values()), time.time() - start
    docs, bad = stats["documents"], stats["bad_records"]
    log(
        f"[prep] records: {bad['records']:,} read, {bad['count']:,} bad ({bad['fraction']:.2%}"
        f"{': ' + ', '.join(f'{k} {v:,}' for k, v in stats['skipped'].items()) if bad['count'] else ''}; listed in {DEAD_LETTER}), "
        f"{stats['duplicates']:,} duplicate documents dropped"
    )
    if len(stats["mixture"]) > 1 or stats["mixture"][0]["weight"] != 1:
        for m in stats["mixture"]:
            log(f"[prep]   {m['input']} (weight {m['weight']:g}): {m['documents_read']:,} documents read -> "
                f"{m['train_documents']:,} train ({m['train_tokens']:,} tokens), {m['val_documents']:,} val")
    log(
        f"[prep] done in {seconds:.1f}s: {docs['train']:,} train / {docs['val']:,} val documents, "
        f"{tokens:,} tokens ({tokens / seconds:,.0f} tokens/s)"
    )
    return stats


def beam_target(out_dir: str | Path, options: PipelineOptions) -> str | Path:
    """Where Beam writes: a remote runner's workers cannot see this task's Cloud Storage mount, so gs:// itself."""
    from data_prep import pipeline

    return out_dir if pipeline.is_direct(options) else mounted_url(out_dir)


def _tokenizer(
    cfg: DataConfig, vocab_size: int, files: list[Path | str], folder: Path, log: Callable[[str], None]
) -> tuple[tokenizers_.TokenizerInfo, str]:
    """Install cfg.tokenizer in canonical form, or train a byte-level BPE on a sample of the corpus."""
    if cfg.tokenizer:
        info = tokenizers_.install(cfg.tokenizer, folder, vocab_size)
        log(f"[prep] tokenizer {cfg.tokenizer} ({info.kind}, {info.vocab_size:,} tokens, eos {info.eos_token!r})")
        return info, cfg.tokenizer
    if vocab_size < tokenizers_.MIN_BPE_VOCAB:
        raise UserError(
            f"model.vocab_size ({vocab_size}) is too small for a byte-level BPE, which needs at least {tokenizers_.MIN_BPE_VOCAB}"
        )
    seen = {"bytes": 0, "documents": 0}
    texts = _bpe_sample(files, cfg.text_field, cfg.bpe_train_max_bytes, cfg.max_document_bytes, seen)
    first = next(texts, None)
    if first is None:
        raise UserError(f"empty corpus: no non-empty UTF-8 documents in the {len(files)} input files of {cfg.input}")
    log(f"[prep] training a byte-level BPE tokenizer (vocab {vocab_size:,}) on up to {_mb(cfg.bpe_train_max_bytes)} of text")
    began = time.time()
    tok = tokenizers_.train_bpe(itertools.chain([first], texts), vocab_size)
    info = tokenizers_.install_trained(tok, folder, vocab_size)
    log(f"[prep] BPE trained on {seen['documents']:,} documents, {_mb(seen['bytes'])}, in {time.time() - began:.1f}s")
    return info, "trained:byte-level-bpe"


def _bpe_sample(
    files: list[Path | str], text_field: str, max_bytes: int, max_document_bytes: int, seen: dict
) -> Iterator[str]:
    """At most max_bytes of documents, files in a fixed pseudo-random order (by hash of their name)."""
    order = sorted(zip((hashlib.sha256(n.encode()).hexdigest() for n in relative_names(files)), files))
    for _, path in order:
        for _, text in read_documents(path, text_field, lambda reason, line: None, max_document_bytes):
            data = text.encode()
            room = max_bytes - seen["bytes"]
            if len(data) >= room:
                text = data[:room].decode("utf-8", "ignore")
            seen["bytes"] += min(len(data), room)
            seen["documents"] += 1
            yield text
            if seen["bytes"] >= max_bytes:
                return


def _run_beam(
    sources: list[tuple[Path | str, int]], cfg: DataConfig, staging: Path | str, remote: bool,
    options: PipelineOptions, log: Callable[[str], None],
) -> dict[str, int]:
    from data_prep import pipeline
    if not pipeline.is_direct(options) and not (remote and all(storage.is_url(f) for f, _ in sources)):
        raise UserError(
            f"the {pipeline.describe(options)} runs on machines without this one's disk: give inputs and output as URLs (gs://...)"
        )
    separate = pipeline.runs_in_worker_processes(options)
    log(f"[prep] Beam ({pipeline.describe(options)}): read, tokenize, split, dedup, pack, write")
    began = time.time()
    # Beam's worker processes already use every core: HF tokenizers' own thread pool in each would only
    # oversubscribe them. Setting the variable also silences tokenizers' warning about forking after
    # parallelism was used (BPE training above). An explicit user setting wins.
    env = {"TOKENIZERS_PARALLELISM": "false"} if separate and "TOKENIZERS_PARALLELISM" not in os.environ else {}
    with _environ(env):
        counters = pipeline.run(sources, cfg, storage.join(staging, "tokenizer"), staging, options)
    log(f"[prep] Beam finished in {time.time() - began:.1f}s")
    return counters


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stats(
    cfg: DataConfig, staging: Path | str, tokenizer_dir: Path, info: tokenizers_.TokenizerInfo, source: str,
    sources: list[tuple[Path | str, int]], size: int, digest: str, counters: dict[str, int],
) -> dict:
    from data_prep.pipeline import shard_stats

    shards = shard_stats(cfg, staging)
    tok_file = tokenizer_dir / (tokenizers_.HF_FILE if info.kind == "hf" else tokenizers_.SP_FILE)
    per_split = lambda key: {s: sum(x[key] for x in shards if x["split"] == s) for s in ("train", "val")}
    skipped = {k.removeprefix("skipped."): v for k, v in sorted(counters.items()) if k.startswith("skipped.") and v}
    bad = sum(skipped.values())
    # A record is a document, JSON line or Parquet row read, good or bad; no_tokens ones were read as good.
    records = counters.get("read.documents", 0) + bad - skipped.get("no_tokens", 0)
    return {
        "documents": {s: counters.get(f"documents.{s}", 0) for s in ("train", "val")},
        "tokens": per_split("tokens"),
        "sequences": per_split("sequences"),
        "padding_tokens": per_split("padding_tokens"),
        "seq_len": cfg.seq_len,
        "record_format": RecordFormat(cfg.packing, cfg.seq_len).describe(),
        "shards": shards,
        "tokenizer": {
            "kind": info.kind, "source": source, "sha256": storage.sha256(tok_file), "vocab_size": info.vocab_size,
            "eos_id": info.eos_id, "bos_id": info.bos_id,
        },
        "input": {"patterns": list(cfg.input), "files": len(sources), "bytes": size, "fingerprint": digest},
        "mixture": mixture.mixture_stats(cfg, [sum(i == k for _, i in sources) for k in range(len(cfg.input))], counters),
        "duplicates": counters.get("duplicates", 0),
        "skipped": skipped,
        "bad_records": {
            "records": records, "count": bad, "fraction": bad / records if records else 0.0,
            "max_fraction": cfg.max_bad_fraction, "file": DEAD_LETTER,
        },
    }


def _check(stats: dict, cfg: DataConfig, n_files: int, source: str, staging: Path | str) -> None:
    """Refuse output that trains nothing or rests on too much bad input, with one line saying why."""
    docs, skipped, bad = stats["documents"], stats["skipped"], stats["bad_records"]
    if not sum(docs.values()):
        if skipped.get("no_tokens") and len(skipped) == 1:
            raise UserError(f"the corpus yields no tokens: all {skipped['no_tokens']} documents tokenize to nothing with {source}")
        raise UserError(f"empty corpus: no usable documents in {n_files} input files (skipped: {skipped or 'none'})")
    if bad["fraction"] > cfg.max_bad_fraction:
        with storage.open(storage.join(staging, DEAD_LETTER), "rb") as f:
            first = f.readline().decode().strip()
        raise UserError(
            f"{bad['count']:,} of {bad['records']:,} input records are bad ({bad['fraction']:.1%}, more than "
            f"data.max_bad_fraction={cfg.max_bad_fraction:g}): {', '.join(f'{k} {v:,}' for k, v in skipped.items())}; "
            f"first: {first}; nothing was published (raise data.max_bad_fraction to keep the rest, with every bad "
            f"record listed in {DEAD_LETTER})"
        )
    if not stats["tokens"]["train"]:
        raise UserError(f"the train split is empty: the corpus has only {sum(docs.values())} document(s), all held out for val")
    if not stats["tokens"]["val"]:
        raise UserError("the val split is empty: its documents were all dropped by data.weights; raise data.val_fraction")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
