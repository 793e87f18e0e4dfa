"""Grain input over the prep step's ArrayRecord shards (their record format is in contract/records.py).

The model reads `inputs` (with `segment_ids`/`positions` for documents packing), predicts `targets`
(the next token) and the loss counts only positions where `mask` is 1.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np

from configs import UserError
from contract.manifest import read_manifest
from contract.records import DTYPE, FIELDS, PAD, RecordFormat, parse_format, shard_glob


def shard_paths(dataset_dir: str | Path, split: str) -> list[str]:
    """The sorted ArrayRecord shards of one split ("train" or "val")."""
    paths = sorted(str(p) for p in Path(dataset_dir).glob(shard_glob(split)))
    if not paths:
        raise UserError(f"no {split} shards ({shard_glob(split)}) in {dataset_dir}")
    return paths


def record_format(dataset_dir: str | Path) -> RecordFormat:
    """The record format from the dataset manifest; concat records when there is no manifest."""
    manifest = read_manifest(dataset_dir)
    if manifest is None:
        return RecordFormat()
    return parse_format(manifest.get("stats", {}).get("record_format", {}), f"{dataset_dir} (manifest)")


def format_of(paths: list[str]) -> RecordFormat:
    """The record layout of the dataset the shards belong to (read from the manifest beside them)."""
    return record_format(Path(paths[0]).parent)


def sequence_length(paths: list[str], fmt: RecordFormat) -> int:
    """Tokens per sequence, from the first record; a record that does not match the manifest is an error."""
    fields = len(fmt.fields)
    source = grain.sources.ArrayRecordDataSource(paths)  # indexes across shards: an empty first shard is fine
    if not len(source):
        raise UserError(f"the split of {paths[0]} holds no sequences in {len(paths)} shard(s)")
    nbytes = len(source[0])
    if nbytes % (4 * fields) or (fmt.seq_len and nbytes != 4 * fields * fmt.seq_len):
        raise UserError(
            f"{paths[0]}...: a record of {nbytes} bytes does not fit the manifest's record_format "
            f"({fmt.packing}, seq_len {fmt.seq_len or 'unset'}, {fields} int32 field(s))"
        )
    return nbytes // (4 * fields)


def to_example(record: bytes, packing: str = "concat") -> dict[str, np.ndarray]:
    """One record -> inputs, next-token targets and a loss mask (+ segment_ids, positions for documents).

    A target is kept only where it is a real token of the same document: pads, the row's last position and
    (documents mode) each document's last token, whose "next token" starts another document, are masked.
    """
    values = np.frombuffer(record, dtype=DTYPE)
    if packing == "documents":
        tokens, segments, positions = values.reshape(len(FIELDS[packing]), -1)
    else:
        tokens = values
    valid = tokens != PAD
    inputs = np.where(valid, tokens, 0).astype(np.int32)
    targets = np.append(inputs[1:], 0).astype(np.int32)
    keep = valid[1:] & valid[:-1]
    if packing == "documents":
        keep &= segments[1:] == segments[:-1]
    example = {"inputs": inputs, "targets": targets, "mask": np.append(keep, False).astype(np.float32)}
    if packing == "documents":
        example["segment_ids"] = segments.astype(np.int32)
        example["positions"] = positions.astype(np.int32)
    return example


def train_iterator(
    paths: list[str], batch_size: int, seed: int, process_index: int = 0, process_count: int = 1,
    fmt: RecordFormat | None = None,
) -> grain.DatasetIterator:
    """An endless, seeded, globally shuffled stream of this process's batches; its state is checkpointable."""
    fmt = fmt or format_of(paths)
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
    if len(ds) < batch_size * process_count:
        raise UserError(f"the train split has {len(ds)} sequences, fewer than one global batch ({batch_size * process_count})")
    ds = ds.seed(seed).shuffle().repeat()[process_index::process_count]
    ds = ds.map(functools.partial(to_example, packing=fmt.packing)).batch(batch_size, drop_remainder=True)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4 * batch_size)))


def eval_batches(paths: list[str], batch_size: int, max_batches: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """The split in order, in batches (with segment_ids/positions for documents); the last batch is padded with fully masked rows."""
    example = functools.partial(to_example, packing=format_of(paths).packing)
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).map(example)
    count = len(ds) if not max_batches else min(len(ds), max_batches * batch_size)
    for start in range(0, count, batch_size):
        rows = [ds[i] for i in range(start, min(start + batch_size, count))]
        rows += [{k: np.zeros_like(v) for k, v in rows[0].items()}] * (batch_size - len(rows))
        yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}
