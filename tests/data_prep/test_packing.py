"""Document-aware packing (the trainer's `documents` record contract) and Beam options for Dataflow."""

from __future__ import annotations

import json

import numpy as np
import pytest

from contract.records import PAD
from data_prep import read_shard
from tests.helpers import prepare
from data_prep.pack import pack
from tests.data_prep.test_prep import make_cfg, write_corpus


def split_record(row: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    assert row.shape == (3 * seq_len,) and row.dtype == np.dtype("<i4")
    return row[:seq_len], row[seq_len : 2 * seq_len], row[2 * seq_len :]


def unpack(rows: np.ndarray, seq_len: int) -> list[list[int]]:
    """The document pieces of `documents` records, in order, after checking each row's segment ids and positions."""
    pieces = []
    for row in rows:
        tokens, segments, positions = split_record(row, seq_len)
        for seg in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == seg)
            assert where.size and (np.diff(where) == 1).all()  # a segment is contiguous
            assert positions[where].tolist() == list(range(where.size))  # positions restart at 0 in each piece
            pieces.append((where[0], tokens[where].tolist()))
        pad = segments == 0
        assert (tokens[pad] == PAD).all() and (positions[pad] == 0).all() and (tokens[~pad] != PAD).all()
        assert pad.sum() == 0 or pad[-pad.sum():].all()  # padding only at the end of a row
    return [piece for _, piece in pieces]


@pytest.mark.parametrize("lengths", [[5, 3, 1], [4], [4, 4], [11], [1] * 9, [3, 9, 2, 4, 1], [], [8, 1]])
def test_documents_packing_loses_nothing(lengths):
    seq_len = 4
    docs = [np.arange(100 * i, 100 * i + n) for i, n in enumerate(lengths)]
    rows = pack(docs, seq_len, "documents")
    flat = np.concatenate(docs).tolist() if docs else []
    assert rows.shape == (-(-len(flat) // seq_len), 3 * seq_len)
    tokens = rows[:, :seq_len].reshape(-1)
    assert tokens[tokens != PAD].tolist() == flat and (tokens[len(flat):] == PAD).all()
    assert np.array_equal(rows[:, :seq_len], pack(docs, seq_len).reshape(-1, seq_len))  # concat's records exactly
    pieces = unpack(rows, seq_len)
    assert [t for piece in pieces for t in piece] == flat
    # Each piece lies inside one document: a document split across k rows gives k pieces.
    assert len(pieces) == sum(
        len({(start + i) // seq_len for i in range(n)}) for start, n in zip(np.cumsum([0, *lengths[:-1]]), lengths)
    )


def test_documents_record_layout_by_hand():
    rows = pack([np.array([10, 11, 12]), np.array([20, 21, 22, 23, 24]), np.array([30])], 4, "documents")
    assert rows.tolist() == [
        [10, 11, 12, 20, 1, 1, 1, 2, 0, 1, 2, 0],
        [21, 22, 23, 24, 1, 1, 1, 1, 0, 1, 2, 3],
        [30, PAD, PAD, PAD, 1, 0, 0, 0, 0, 0, 0, 0],
    ]


def test_documents_mode_end_to_end(tmp_path):
    """Same shards as concat mode in the tokens field, plus segment ids and positions; the manifest says so."""
    corpus = write_corpus(tmp_path / "corpus", n=20, seed=41)
    concat = prepare(make_cfg([str(corpus / "*")], seq_len=16), 400, tmp_path / "concat", log=lambda _: None)
    docs = prepare(make_cfg([str(corpus / "*")], seq_len=16, packing="documents"), 400, tmp_path / "docs", log=lambda _: None)
    assert docs["record_format"] == {
        "dtype": "int32le", "pad": -1, "packing": "documents", "fields": ["tokens", "segment_ids", "positions"], "seq_len": 16
    }
    for a, b in zip(concat["shards"], docs["shards"]):
        assert (a["sequences"], a["tokens"], a["padding_tokens"]) == (b["sequences"], b["tokens"], b["padding_tokens"])
        rows = read_shard(tmp_path / "docs" / b["name"])
        if b["sequences"]:
            assert np.array_equal(rows[:, :16], read_shard(tmp_path / "concat" / a["name"]))
            eos = 0
            for piece in unpack(rows, 16):
                assert eos not in piece[:-1]  # a piece never crosses a document end
    assert concat["documents"] == docs["documents"] and concat["tokens"] == docs["tokens"]


def test_beam_args_reach_a_dataflow_pipeline(tmp_path):
    """data.beam_args become the options of the built graph, Dataflow's included (built, not submitted)."""
    from apache_beam.options.pipeline_options import (
        GoogleCloudOptions,
        StandardOptions,
        WorkerOptions,
    )

    from data_prep import pipeline

    args = ["--runner=DataflowRunner", "--project=my-project", "--region=europe-west4", "--temp_location=gs://my-bucket/tmp",
            "--max_num_workers=32", "--dry_run=True"]  # dry_run: Beam skips its network checks of the bucket
    cfg = make_cfg(["gs://my-bucket/corpus/*.jsonl"], beam_args=args)
    options = pipeline.pipeline_options(cfg.beam_args)
    assert not pipeline.is_direct(options) and pipeline.describe(options) == "DataflowRunner"
    p = pipeline.build([("gs://my-bucket/corpus/a.jsonl", 0)], cfg, "gs://my-bucket/out/tokenizer", "gs://my-bucket/out", options)
    assert type(p.runner).__name__ == "DataflowRunner"
    gcp = p.options.view_as(GoogleCloudOptions)
    assert (gcp.project, gcp.region, gcp.temp_location) == ("my-project", "europe-west4", "gs://my-bucket/tmp")
    assert p.options.view_as(WorkerOptions).max_num_workers == 32
    assert p.options.view_as(StandardOptions).runner == "DataflowRunner"
    names = {t.unique_name for t in p.to_runner_api().components.transforms.values()}
    assert {"Read", "Tokenize", "PerShard", "Write", "DeadLetter"} <= names


def test_inspect_reads_documents_records(tmp_path):
    from data_prep.describe import describe_dataset

    corpus = write_corpus(tmp_path / "corpus", n=12, seed=42)
    stats = prepare(make_cfg([str(corpus / "*")], seq_len=16, packing="documents"), 400, tmp_path / "out", log=lambda _: None)
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"kind": "dataset", "stats": stats}))
    report = describe_dataset(tmp_path / "out")
    assert "packing documents" in report and f"{stats['documents']['train']:,} documents" in report
