"""`maxpipe data inspect DIR`: a prepared dataset's statistics and a few decoded sequences."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from configs import UserError
from contract.manifest import MANIFEST, read_manifest
from contract.records import PAD
from data_prep.pack import read_shard
from data_prep.tokenizer import Encoder


def describe_dataset(directory: str | Path, samples: int = 2, sample_chars: int = 400) -> str:
    """A readable report: counts, padding, skips, document lengths (histogram) and decoded samples."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise UserError(f"{directory} is not a complete dataset (no {MANIFEST})")
    stats = manifest.get("stats", manifest)
    if "shards" not in stats:
        raise UserError(f"{directory} holds a {manifest.get('kind', 'non-dataset')} artifact, not a dataset")
    encoder = Encoder(directory / "tokenizer")
    tok = stats["tokenizer"]
    lines = [
        f"dataset {manifest.get('version', '?')}  {directory}",
        f"  input       {stats['input']['files']:,} files, {stats['input']['bytes'] / 1e6:,.1f} MB  {stats['input']['patterns']}",
        f"  tokenizer   {tok['kind']} from {tok['source']}, {tok['vocab_size']:,} tokens, eos {tok['eos_id']}",
        f"  skipped     {stats['skipped'] or 'nothing'}"
        + (f" (listed in {stats['bad_records']['file']})" if stats.get("bad_records", {}).get("count") else ""),
        f"  duplicates  {stats.get('duplicates', 0):,} dropped; packing {stats['record_format'].get('packing', 'concat')}",
    ]
    # Only the tokens field: `documents` records also hold segment ids and positions (data_prep/pack.py).
    rows = {
        split: [read_shard(directory / s["name"])[:, : stats["seq_len"]] for s in stats["shards"] if s["split"] == split]
        for split in ("train", "val")
    }
    for split in ("train", "val"):
        tokens, padding = stats["tokens"][split], stats["padding_tokens"][split]
        lines.append(
            f"  {split:<5}       {stats['documents'][split]:,} documents, {tokens:,} tokens, "
            f"{stats['sequences'][split]:,} sequences of {stats['seq_len']}, padding {padding / max(tokens + padding, 1):.2%}"
        )
    lengths = np.concatenate([_document_lengths(shard, tok["eos_id"]) for shard in rows["train"] + rows["val"]])
    lines += ["", "  document length (tokens)  documents"] + _histogram(lengths)
    val_rows = [r for r in rows["val"] if len(r)]
    val = np.concatenate(val_rows) if val_rows else np.zeros((0, stats["seq_len"]), np.int32)
    for i, row in enumerate(val[:samples]):
        text = encoder.decode([int(t) for t in row if t != PAD])
        lines += ["", f"  val sequence {i}:", "  " + repr(text[:sample_chars]) + ("…" if len(text) > sample_chars else "")]
    return "\n".join(lines)


def _document_lengths(rows: np.ndarray, eos_id: int) -> np.ndarray:
    """Lengths of the documents packed into one shard (each ends with EOS)."""
    flat = rows[rows != PAD]
    ends = np.flatnonzero(flat == eos_id)
    return np.diff(np.concatenate([[-1], ends])) if ends.size else np.zeros(0, np.int64)


def _histogram(lengths: np.ndarray) -> list[str]:
    if not lengths.size:
        return ["  (no complete documents)"]
    edges = 2 ** np.arange(0, int(np.ceil(np.log2(lengths.max() + 1))) + 1)
    counts, _ = np.histogram(lengths, bins=edges)
    width = 40 / max(counts.max(), 1)
    return [
        f"  {lo:>8,} - {hi - 1:<8,}  {n:>8,}  {'█' * int(np.ceil(n * width)) if n else ''}"
        for lo, hi, n in zip(edges[:-1], edges[1:], counts) if n
    ]
