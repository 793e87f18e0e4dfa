"""Input resolution, fingerprints, document reading and packing."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from configs import UserError
from contract.records import PAD, shard_name
from data_prep import fingerprint, resolve_inputs
from data_prep.pack import pack, read_shard, write_shard
from data_prep.sources import read_documents


def test_stdlib_expands_to_the_standard_library():
    files = resolve_inputs(["stdlib"])
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 500 and files == sorted(files, key=str)
    assert all(f.suffix == ".py" and root in f.parents for f in files)
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.parts)
    assert root / "os.py" in files


def test_globs_are_sorted_and_deduplicated(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    files = resolve_inputs([str(tmp_path / "*.txt"), str(tmp_path / "a.txt"), str(tmp_path / "**" / "*")])
    assert files == [tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "sub" / "c.jsonl"]


@pytest.mark.parametrize("pattern", ["missing/*.txt", "memory://no-bucket/*.txt"])
def test_unmatched_pattern_is_a_user_error(tmp_path, pattern):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(UserError, match="no input files match"):
        resolve_inputs([str(tmp_path / "a.txt"), pattern if "://" in pattern else str(tmp_path / pattern)])


def test_fingerprint_follows_content_not_location(tmp_path):
    for d in ("one", "two"):
        (tmp_path / d / "sub").mkdir(parents=True)
        (tmp_path / d / "a.txt").write_text("alpha")
        (tmp_path / d / "sub" / "b.txt").write_text("beta")
    one, two = (resolve_inputs([str(tmp_path / d / "**" / "*.txt")]) for d in ("one", "two"))
    assert fingerprint(one) == fingerprint(two) and len(fingerprint(one)) == 64
    (tmp_path / "two" / "a.txt").write_text("alphA")
    assert fingerprint(one) != fingerprint(two)
    before = fingerprint(one)
    shutil.move(tmp_path / "one" / "sub" / "b.txt", tmp_path / "one" / "b.txt")  # same bytes, other name
    assert fingerprint(resolve_inputs([str(tmp_path / "one" / "*.txt")])) != before


def test_read_documents_reports_skips(tmp_path):
    skipped = []
    skip = lambda reason, line: skipped.append((line, reason))
    (tmp_path / "x.jsonl").write_bytes(b'{"t": "a"}\n{"t": 3}\n\n{"t": "b"}\nnope\n\xff\n')
    docs = list(read_documents(tmp_path / "x.jsonl", "t", skip))
    assert docs == [(1, "a"), (4, "b")]
    assert skipped == [(2, "missing_text_field"), (3, "empty"), (5, "bad_json"), (6, "invalid_utf8")]
    (tmp_path / "y.py").write_text("print(1)\n")
    assert list(read_documents(tmp_path / "y.py", "t", skip)) == [(0, "print(1)\n")]
    assert list(read_documents(tmp_path / "gone.txt", "t", skip)) == [] and skipped[-1] == (0, "unreadable_file")


def test_pack_drops_nothing_and_pads_the_tail():
    docs = [np.arange(5), np.arange(100, 103), np.array([7])]
    rows = pack(docs, 4)
    assert rows.shape == (3, 4) and rows.dtype == np.dtype("<i4")
    assert rows.reshape(-1).tolist() == [0, 1, 2, 3, 4, 100, 101, 102, 7, PAD, PAD, PAD]
    assert pack([np.arange(8)], 4).shape == (2, 4) and pack([], 4).shape == (0, 4)


def test_shard_round_trip(tmp_path):
    rows = pack([np.arange(70)], 16)
    path = tmp_path / shard_name("train", 3, 12)
    assert path.name == "train-00003-of-00012.array_record"
    write_shard(path, rows)
    assert np.array_equal(read_shard(path), rows) and [p.name for p in tmp_path.iterdir()] == [path.name]
    write_shard(path, rows[:0])
    assert read_shard(path).shape[0] == 0


def test_corrupt_gzip_and_too_deep_json_are_bad_records_not_crashes(tmp_path):
    import gzip

    from data_prep.sources import read_documents

    blob = bytearray(gzip.compress(b'{"text": "fine"}\n' * 2000))
    blob[40:60] = b"\xff" * 20  # damage the deflate stream itself, not just its end
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(blob))
    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    (tmp_path / "deep.jsonl").write_text(deep + '{"text": "ok"}\n')
    for name, reason in (("bad.jsonl.gz", "unreadable_file"), ("deep.jsonl", "bad_json")):
        skipped = []
        list(read_documents(tmp_path / name, "text", lambda why, line: skipped.append(why)))
        assert reason in skipped, (name, skipped)
