"""Document-packed records: masks, segment ids and positions, and a packed row scoring like its documents alone."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from configs import TrainConfig, TrainSettings, UserError, load_config
from trainer.train.data import eval_batches, record_format, sequence_length, shard_paths, to_example, train_iterator
from trainer.train.loss import token_loss
from trainer.model.decoder import Transformer

PAD = -1


def write_shard(path: Path, records: list[np.ndarray]) -> None:
    """One ArrayRecord file of little-endian int32 records."""
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(np.asarray(r, "<i4").tobytes())
    writer.close()


def write_manifest(directory: Path, seq_len: int, packing: str | None) -> None:
    """The prep step's manifest with its record_format (no `fields` for old concat datasets)."""
    fmt = {"dtype": "int32le", "pad": PAD}
    if packing:
        fields = ["tokens", "segment_ids", "positions"] if packing == "documents" else ["tokens"]
        fmt.update(packing=packing, fields=fields, seq_len=seq_len)
    (directory / "manifest.json").write_text(json.dumps({"kind": "dataset", "stats": {"record_format": fmt}}))


def pack_documents(docs: list[list[int]], seq_len: int) -> np.ndarray:
    """One documents-mode record: tokens, segment ids, positions, each padded to seq_len."""
    tokens = np.full(seq_len, PAD, np.int32)
    segments = np.zeros(seq_len, np.int32)
    positions = np.zeros(seq_len, np.int32)
    at = 0
    for i, doc in enumerate(docs, start=1):
        tokens[at : at + len(doc)] = doc
        segments[at : at + len(doc)] = i
        positions[at : at + len(doc)] = np.arange(len(doc))
        at += len(doc)
    return np.concatenate([tokens, segments, positions])


def random_dataset(directory: Path, rows: int, seq_len: int, vocab: int, seed: int = 0, shards: int = 2) -> Path:
    """A concat-mode dataset of random token rows (train and val splits) with its manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, vocab, (rows, seq_len), dtype=np.int32)
    for i in range(shards):
        write_shard(directory / f"train-{i:05d}-of-{shards:05d}.array_record", list(data[i::shards]))
    write_shard(directory / "val-00000-of-00001.array_record", list(data[:4]))
    write_manifest(directory, seq_len, "concat")
    return directory


def split_train(cfg: TrainConfig) -> tuple[TrainConfig, TrainSettings]:
    """The train config as the pipeline hands it to train(): only the fields that version a training (reading
    any other raises AttributeError), and the run settings apart."""
    settings = set(TrainSettings.model_fields)
    versioned = TrainConfig.model_construct(**cfg.model_dump(exclude=settings | {"continue_from"}))
    return versioned, TrainSettings(**cfg.model_dump(include=settings))


def test_document_record_masks_each_documents_last_target(tmp_path: Path) -> None:
    record = pack_documents([[5, 6, 7], [8, 9]], seq_len=7)
    ex = to_example(record.astype("<i4").tobytes(), "documents")
    np.testing.assert_array_equal(ex["inputs"], [5, 6, 7, 8, 9, 0, 0])
    np.testing.assert_array_equal(ex["targets"], [6, 7, 8, 9, 0, 0, 0])
    # 7 -> 8 crosses into the next document and 9 -> pad is padding: both masked.
    np.testing.assert_array_equal(ex["mask"], [1, 1, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 1, 2, 2, 0, 0])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 0, 1, 0, 0])


def test_manifest_decides_the_layout(tmp_path: Path) -> None:
    assert record_format(tmp_path).packing == "concat"  # no manifest: an old dataset
    write_manifest(tmp_path, 8, None)
    assert record_format(tmp_path).packing == "concat"
    write_manifest(tmp_path, 8, "documents")
    write_shard(tmp_path / "train-0.array_record", [pack_documents([[1, 2, 3]], 8)])
    fmt = record_format(tmp_path)
    assert fmt.packing == "documents"
    assert sequence_length(shard_paths(tmp_path, "train"), fmt) == 8
    write_manifest(tmp_path, 16, "documents")
    with pytest.raises(UserError, match="does not fit the manifest"):
        sequence_length(shard_paths(tmp_path, "train"), record_format(tmp_path))


def test_packed_row_scores_like_each_document_alone(tmp_path: Path) -> None:
    seq_len, docs = 32, [list(range(3, 15)), list(range(40, 57))]  # 12 + 17 tokens, 3 pads
    write_manifest(tmp_path, seq_len, "documents")
    write_shard(tmp_path / "train-00000-of-00001.array_record", [pack_documents(docs, seq_len)] * 2)
    write_shard(tmp_path / "val-00000-of-00001.array_record", [pack_documents(docs, seq_len)])
    batch = next(train_iterator(shard_paths(tmp_path, "train"), 2, seed=0))
    assert set(batch) == {"inputs", "targets", "mask", "segment_ids", "positions"}
    val = next(eval_batches(shard_paths(tmp_path, "val"), 1))
    assert set(val) == set(batch)

    cfg = load_config("tiny").model
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
    logits = model.apply({"params": params}, val["inputs"], val["positions"], val["segment_ids"])
    losses = jax.nn.log_softmax(logits)[0, np.arange(seq_len), val["targets"][0]]
    at = 0
    for doc in docs:
        alone = model.apply({"params": params}, jnp.asarray([doc]))
        want = jax.nn.log_softmax(alone)[0, np.arange(len(doc) - 1), np.asarray(doc[1:])]
        # float32 logits of the same computation on different sequence lengths: reassociation-level differences.
        np.testing.assert_allclose(losses[at : at + len(doc) - 1], want, rtol=1e-5, atol=1e-5)
        at += len(doc)
    _, count = token_loss(logits, val["targets"], val["mask"])
    assert count == sum(len(d) - 1 for d in docs)


def test_an_empty_first_shard_is_skipped_and_an_empty_split_is_one_line(tmp_path: Path) -> None:
    write_shard(tmp_path / "train-00000-of-00002.array_record", [])
    write_shard(tmp_path / "train-00001-of-00002.array_record", [np.arange(16, dtype="<i4")])
    assert sequence_length(shard_paths(tmp_path, "train"), record_format(tmp_path)) == 16
    (tmp_path / "train-00001-of-00002.array_record").unlink()
    with pytest.raises(UserError, match="holds no sequences"):
        sequence_length(shard_paths(tmp_path, "train"), record_format(tmp_path))
