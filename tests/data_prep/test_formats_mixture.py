"""Input formats (.jsonl.gz, Parquet), mixture weights, exact dedup and determinism across worker counts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from configs import ConfigError, load_config
from data_prep import mixture
from tests.helpers import prepare
from data_prep.sources import read_documents
from tests.data_prep.test_prep import check_lossless, documents, make_cfg, write_corpus

QUIET = {"log": lambda _: None}


def test_jsonl_gz_and_parquet_read_like_jsonl(tmp_path):
    texts = ["first ✓", "second\nline", "", "third", None]
    rows = [{"text": t, "n": i} for i, t in enumerate(texts)]
    plain = tmp_path / "a.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    table = pa.table({"text": texts, "n": list(range(5))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)  # rows span several row groups
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "other.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    results = {}
    for name in ("a.jsonl", "a.jsonl.gz", "a.parquet", "other.parquet", "ints.parquet"):
        skipped = []
        docs = list(read_documents(tmp_path / name, "text", lambda reason, line, out=skipped: out.append((line, reason))))
        results[name] = (docs, skipped)
    expected = ([(1, "first ✓"), (2, "second\nline"), (4, "third")], [(3, "empty"), (5, "missing_text_field")])
    assert results["a.jsonl"] == results["a.jsonl.gz"] == results["a.parquet"] == expected
    assert results["other.parquet"] == results["ints.parquet"] == ([], [(0, "missing_text_field")])


def mixed_corpus(root: Path) -> tuple[Path, Path, Path]:
    """Three sources: text files, a gzipped JSON-lines file and a Parquet file; one document appears in all three."""
    text = write_corpus(root / "code", n=30, seed=31)
    shared = (text / "doc000.txt").read_text(encoding="utf-8")
    lines = [f"json document {i} " + "word " * (i % 17) for i in range(40)] + [shared]
    (root / "web").mkdir()
    (root / "web" / "a.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in lines).encode()))
    (root / "books").mkdir()
    pq.write_table(pa.table({"text": [f"book {i}: " + "page " * i for i in range(25)] + [shared, shared]}), root / "books" / "b.parquet")
    return text, root / "web", root / "books"


def test_dedup_keeps_one_copy_per_text(tmp_path):
    code, web, books = mixed_corpus(tmp_path)
    patterns = [str(code / "*"), str(web / "*"), str(books / "*")]
    stats = prepare(make_cfg(patterns, val_fraction=0.1), 400, tmp_path / "out", **QUIET)
    texts = documents(list(code.iterdir()))
    texts += [f"json document {i} " + "word " * (i % 17) for i in range(40)] + [f"book {i}: " + "page " * i for i in range(25)]
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer" / "tokenizer.json"))
    check_lossless(tmp_path / "out", stats, texts, lambda t: tok.encode(t).ids)
    assert stats["duplicates"] == 3
    # The first occurrence by (path, line) is kept: books/b.parquet row 26; its row 27, code/ and web/ copies go.
    assert [m["duplicates"] for m in stats["mixture"]] == [1, 1, 1]
    assert [m["documents_read"] for m in stats["mixture"]] == [30, 41, 27]
    undeduped = prepare(make_cfg(patterns, val_fraction=0.1, dedup=False), 400, tmp_path / "all", **QUIET)
    assert sum(undeduped["documents"].values()) == sum(stats["documents"].values()) + 3 and undeduped["duplicates"] == 0


def test_weights_repeat_and_subsample_train_documents(tmp_path):
    code, web, books = mixed_corpus(tmp_path)
    patterns, weights = [str(code / "*"), str(web / "*"), str(books / "*")], [2.0, 0.5, 1.5]
    stats = prepare(make_cfg(patterns, weights=weights, val_fraction=0.1), 400, tmp_path / "out", **QUIET)
    plain = prepare(make_cfg(patterns, val_fraction=0.1), 400, tmp_path / "plain", **QUIET)
    for w, m, p in zip(weights, stats["mixture"], plain["mixture"]):
        assert m["weight"] == w and m["val_documents"] == p["val_documents"]  # val is not weighted
        kept = p["train_documents"]
        assert int(w) * kept <= m["train_documents"] <= (int(w) + 1) * kept
    assert stats["mixture"][0]["train_documents"] == 2 * plain["mixture"][0]["train_documents"]
    assert stats["mixture"][0]["train_tokens"] == 2 * plain["mixture"][0]["train_tokens"]
    assert sum(m["train_tokens"] for m in stats["mixture"]) == stats["tokens"]["train"]
    assert stats["documents"]["train"] == sum(m["train_documents"] for m in stats["mixture"])


def test_copies_follow_the_weight_on_average():
    import hashlib

    digests = [hashlib.sha256(str(i).encode()).digest() for i in range(20000)]
    for w in (0.25, 1.0, 2.7):
        mean = sum(mixture.copies(w, d) for d in digests) / len(digests)
        assert abs(mean - w) < 0.02 and {mixture.copies(w, d) for d in digests} <= {int(w), int(w) + 1}


def test_same_bytes_with_one_or_two_worker_processes(tmp_path):
    """Duplicates, weights, three formats: byte-identical output and stats with 1 or 2 worker processes."""
    code, web, books = mixed_corpus(tmp_path)
    patterns = [str(code / "*"), str(web / "*"), str(books / "*")]
    runs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        args = ["--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"]
        cfg = make_cfg(patterns, weights=[2.0, 0.5, 1.5], packing="documents", beam_args=args, train_shards=3, val_fraction=0.1)
        stats = prepare(cfg, 400, out, **QUIET)
        runs.append((stats, {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}))
    assert runs[0] == runs[1]
    assert runs[0][0]["duplicates"] == 3


def test_weights_need_one_per_input():
    with pytest.raises(ConfigError, match=r"data.weights has 2 values for 1 data.input globs"):
        load_config(None, ["data.weights=[1, 2]"])
    assert load_config(None, ["data.input=[a, b]", "data.weights=[1, 0.5]"]).data.weights == [1, 0.5]


def test_the_document_forced_into_val_is_one_that_is_kept(tmp_path):
    # With a tiny val_fraction, val is the one document with the smallest split key. Most documents
    # here are in a glob whose weight drops almost all of them: the forced one must not be among those.
    code = write_corpus(tmp_path / "code", n=3, seed=5)
    (tmp_path / "web").mkdir()
    lines = [f"web page {i} " + "text " * (i % 13) for i in range(100)]
    (tmp_path / "web" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    patterns = [str(code / "*"), str(tmp_path / "web" / "*")]
    stats = prepare(make_cfg(patterns, weights=[1.0, 0.01], val_fraction=1e-9), 400, tmp_path / "out", **QUIET)
    assert stats["documents"]["val"] == 1 and stats["tokens"]["val"] > 0
