"""Bad input: each bad record is counted, listed in dead_letter.jsonl, and the run goes on below data.max_bad_fraction."""

from __future__ import annotations

import json
import resource
import tracemalloc
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from configs import UserError
from tests.helpers import prepare
from data_prep.sources import read_documents
from tests.data_prep.test_prep import (
    assert_nothing_written,
    check_lossless,
    make_cfg,
    write_corpus,
)

QUIET = {"log": lambda _: None}
BIG_LINE_BYTES = 50_000_000


def dead_letter(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "dead_letter.jsonl").read_text().splitlines()]


def bad_corpus(folder: Path) -> tuple[list[str], list[tuple[str, int, str]]]:
    """Good documents mixed with one of each kind of bad record; returns (good texts, expected dead letters)."""
    write_corpus(folder, n=30, seed=21)
    texts = [p.read_text(encoding="utf-8") for p in sorted(folder.iterdir())]
    (folder / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    (folder / "empty.txt").write_bytes(b"")
    (folder / "blank.py").write_text("  \n\t\n")
    (folder / "image.txt").write_bytes(bytes(range(256)) * 4)  # a binary file among text files (NULs, not UTF-8 either)
    (folder / "nul.txt").write_bytes(b"valid utf-8 \x00 but binary")
    lines = [json.dumps({"text": "a good json line"}), "{broken", json.dumps({"body": "no text"}), json.dumps({"text": ""}),
             json.dumps({"text": "another good one ✓"})]
    (folder / "docs.jsonl").write_bytes("\n".join(lines).encode() + b"\n\xc3\x28 invalid\n")
    texts += ["a good json line", "another good one ✓"]
    expected = [
        ("blank.py", 0, "empty"), ("docs.jsonl", 2, "bad_json"), ("docs.jsonl", 3, "missing_text_field"),
        ("docs.jsonl", 4, "empty"), ("docs.jsonl", 6, "invalid_utf8"), ("empty.txt", 0, "empty"),
        ("image.txt", 0, "binary"), ("latin1.txt", 0, "invalid_utf8"), ("nul.txt", 0, "binary"),
    ]
    return texts, [(str(folder / name), line, reason) for name, line, reason in expected]


def test_bad_records_are_counted_listed_and_skipped(tmp_path):
    texts, expected = bad_corpus(tmp_path / "corpus")
    lines = []
    stats = prepare(make_cfg([str(tmp_path / "corpus" / "*")], max_bad_fraction=0.25), 400, tmp_path / "out", log=lines.append)
    assert [(d["source"], d["line"], d["reason"]) for d in dead_letter(tmp_path / "out")] == expected
    assert stats["skipped"] == {"bad_json": 1, "binary": 2, "empty": 3, "invalid_utf8": 2, "missing_text_field": 1}
    assert stats["bad_records"] == {
        "records": len(texts) + 9, "count": 9, "fraction": 9 / (len(texts) + 9), "max_fraction": 0.25, "file": "dead_letter.jsonl",
    }
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer" / "tokenizer.json"))
    check_lossless(tmp_path / "out", stats, texts, lambda t: tok.encode(t).ids)
    summary = next(line for line in lines if "bad (" in line)
    assert "9 bad" in summary and "binary 2" in summary and "dead_letter.jsonl" in summary


def test_too_many_bad_records_publish_nothing(tmp_path):
    texts, _ = bad_corpus(tmp_path / "corpus")
    with pytest.raises(UserError) as error:
        prepare(make_cfg([str(tmp_path / "corpus" / "*")], max_bad_fraction=0.2), 400, tmp_path / "out", **QUIET)
    message = str(error.value)
    assert "\n" not in message and f"9 of {len(texts) + 9} input records are bad" in message
    assert "data.max_bad_fraction=0.2" in message and "blank.py" in message and "nothing was published" in message
    assert_nothing_written(tmp_path / "out")


def test_a_50_mb_line_is_skipped_without_loading_it(tmp_path):
    """A single 50 MB JSON line and a 50 MB one-line text file: too_large bad records; memory stays far below them."""
    corpus = write_corpus(tmp_path / "corpus", n=20, seed=22)
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.iterdir())]
    with open(corpus / "big.jsonl", "wb") as f:
        f.write(json.dumps({"text": "short one"}).encode() + b"\n")
        f.write(b'{"text": "' + b"x" * BIG_LINE_BYTES + b'"}\n')
        f.write(json.dumps({"text": "after the long line"}).encode() + b"\n")
    (corpus / "big.txt").write_bytes(b"y" * BIG_LINE_BYTES)
    texts += ["short one", "after the long line"]
    for name, expected in (("big.jsonl", [(1, "short one"), (3, "after the long line")]), ("big.txt", [])):
        skipped = []
        tracemalloc.start()
        assert list(read_documents(corpus / name, "text", lambda *r, out=skipped: out.append(r), 1_000_000)) == expected
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 5_000_000 and skipped == [("too_large", 2 if name == "big.jsonl" else 0)]  # read in bounded chunks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = prepare(
        make_cfg([str(corpus / "*")], max_document_bytes=1_000_000, max_bad_fraction=0.1), 400, tmp_path / "out", **QUIET
    )
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib * 1024 < BIG_LINE_BYTES  # neither the line nor the file was ever held whole
    assert [(Path(d["source"]).name, d["line"], d["reason"]) for d in dead_letter(tmp_path / "out")] == [
        ("big.jsonl", 2, "too_large"), ("big.txt", 0, "too_large")
    ]
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer" / "tokenizer.json"))
    check_lossless(tmp_path / "out", stats, texts, lambda t: tok.encode(t).ids)


def test_truncated_gzip_and_corrupt_parquet_are_unreadable(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n=40, seed=23)
    (corpus / "cut.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    (corpus / "broken.parquet").write_bytes(b"PAR1 not really")
    stats = prepare(make_cfg([str(corpus / "*")]), 400, tmp_path / "out", **QUIET)
    assert stats["skipped"] == {"unreadable_file": 2}
    assert sorted((Path(d["source"]).name, d["reason"]) for d in dead_letter(tmp_path / "out")) == [
        ("broken.parquet", "unreadable_file"), ("cut.jsonl.gz", "unreadable_file")
    ]


@pytest.mark.parametrize("pattern", ["nothing/*.txt", "corpus/*.parquet"])
def test_glob_matching_nothing(tmp_path, pattern):
    write_corpus(tmp_path / "corpus", n=4)
    with pytest.raises(UserError, match=r"^no input files match '.*'$"):
        prepare(make_cfg([str(tmp_path / "corpus" / "*"), str(tmp_path / pattern)], weights=[1, 1]), 400, tmp_path / "out", **QUIET)
    assert_nothing_written(tmp_path / "out")
