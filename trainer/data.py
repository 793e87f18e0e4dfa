"""Grain input over the prep step's ArrayRecord shards.

A record is one packed sequence: `seq_len` little-endian int32 token ids, padded with -1 (see the
dataset manifest's `record_format`). The model reads `inputs`, predicts `targets` (the next token)
and the loss counts only positions where `mask` is 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np

from configs import UserError

PAD = -1


def shard_paths(dataset_dir: str | Path, split: str) -> list[str]:
    """The sorted ArrayRecord shards of one split ("train" or "val")."""
    paths = sorted(str(p) for p in Path(dataset_dir).glob(f"{split}-*.array_record"))
    if not paths:
        raise UserError(f"no {split} shards ({split}-*.array_record) in {dataset_dir}")
    return paths


def to_example(record: bytes) -> dict[str, np.ndarray]:
    """One record -> inputs, next-token targets and a loss mask (pads and the last position are masked)."""
    tokens = np.frombuffer(record, dtype="<i4")
    valid = tokens != PAD
    inputs = np.where(valid, tokens, 0).astype(np.int32)
    targets = np.append(inputs[1:], 0).astype(np.int32)
    mask = np.append(valid[1:], False).astype(np.float32)
    return {"inputs": inputs, "targets": targets, "mask": mask}


def train_iterator(
    paths: list[str], batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
    """An endless, seeded, globally shuffled stream of this process's batches; its state is checkpointable."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
    if len(ds) < batch_size * process_count:
        raise UserError(f"the train split has {len(ds)} sequences, fewer than one global batch ({batch_size * process_count})")
    ds = ds.seed(seed).shuffle().repeat()[process_index::process_count]
    ds = ds.map(to_example).batch(batch_size, drop_remainder=True)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4 * batch_size)))


def eval_batches(paths: list[str], batch_size: int, max_batches: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """The split in order, in batches; the last batch is filled with fully masked rows."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).map(to_example)
    count = len(ds) if not max_batches else min(len(ds), max_batches * batch_size)
    for start in range(0, count, batch_size):
        rows = [ds[i] for i in range(start, min(start + batch_size, count))]
        rows += [{k: np.zeros_like(v) for k, v in rows[0].items()}] * (batch_size - len(rows))
        yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}
