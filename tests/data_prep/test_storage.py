"""Prep through fsspec URLs: inputs from and output to file:// and memory:// (gs:// in production)."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import fsspec
import pytest

from configs import UserError
from data_prep import read_shard, resolve_inputs, storage
from tests.helpers import prepare
from data_prep.sources import read_documents, relative_names
from tests.data_prep.test_prep import make_cfg, write_corpus

QUIET = {"log": lambda _: None}


@pytest.fixture
def memory():
    """A fresh memory:// folder (memory:// is one per process: use the in-memory Beam runner with it)."""
    root = f"memory://maxpipe-test-{uuid.uuid4().hex}"
    yield root
    storage.remove(root)


def tree(root: str | Path) -> dict[str, bytes]:
    """Every file under a folder or URL, relative name -> bytes."""
    fs, _, (base,) = fsspec.core.get_fs_token_paths(str(root), expand=False)
    return {f[len(base):].lstrip("/"): fs.cat_file(f) for f in fs.find(base)}


def corpus_with_jsonl(folder: Path) -> Path:
    write_corpus(folder, n=16, seed=11)
    (folder / "sub").mkdir()
    (folder / "sub" / "a.jsonl").write_text('{"text": "a json document"}\nnot json\n{"text": "another one ✓"}\n')
    return folder


def without_patterns(stats: dict) -> dict:
    return {**stats, "input": {**stats["input"], "patterns": None}, "mixture": [{**m, "input": None} for m in stats["mixture"]]}


def test_storage_helpers(tmp_path, memory):
    (tmp_path / "a.txt").write_bytes(b"abc")
    storage.upload(tmp_path / "a.txt", f"{memory}/d/a.txt")
    assert storage.glob(f"{memory}/**/*.txt") == [f"{memory.replace('memory://', 'memory:///')}/d/a.txt"]
    assert storage.size(f"{memory}/d/a.txt") == 3 and storage.sha256(f"{memory}/d/a.txt") == hashlib.sha256(b"abc").hexdigest()
    with storage.download_to_temp(f"{memory}/d/a.txt") as local:
        assert local.read_bytes() == b"abc"
    assert not local.exists()
    assert storage.key("gs://b/x/y") == "/b/x/y" and storage.key("file:///tmp/x") == "/tmp/x"
    assert list(read_documents(f"{memory}/d/a.txt", "text", print)) == [(0, "abc")]
    skipped = []
    assert list(read_documents(f"{memory}/gone.txt", "text", lambda *r: skipped.append(r))) == []
    assert skipped == [("unreadable_file", 0)]


def test_url_inputs_give_the_same_dataset(tmp_path, memory):
    """file:// globs and memory:// files: same files, fingerprint, stats and shard bytes as local paths."""
    corpus = corpus_with_jsonl(tmp_path / "corpus")
    storage.upload_dir(corpus, f"{memory}/corpus")
    names = [str(f.relative_to(corpus)) for f in resolve_inputs([str(corpus / "**" / "*")])]
    runs = {}
    for kind, pattern in [("local", str(corpus / "**" / "*")), ("file", f"file://{corpus}/**/*"), ("memory", f"{memory}/corpus/**/*")]:
        files = resolve_inputs([pattern])
        assert relative_names(files) == names and all(storage.is_url(f) == (kind != "local") for f in files)
        out = tmp_path / f"out-{kind}"
        stats = prepare(make_cfg([pattern], val_fraction=0.3, max_bad_fraction=0.1), 400, out, **QUIET)
        dead = json.loads(tree(out).pop("dead_letter.jsonl"))  # names the file by its path or URL
        assert dead["source"] == str(files[-1]) and (dead["line"], dead["reason"]) == (2, "bad_json")
        runs[kind] = (without_patterns(stats), {k: v for k, v in tree(out).items() if k != "dead_letter.jsonl"})
    assert runs["local"][0]["input"]["files"] == 17 and runs["local"][0]["skipped"] == {"bad_json": 1}
    assert runs["local"] == runs["file"] == runs["memory"]


def test_output_to_memory_url(tmp_path, memory):
    """Shards are written locally, uploaded to staging and published: same bytes and sha256s as a local run."""
    corpus = write_corpus(tmp_path / "corpus", n=20, seed=12)
    cfg = make_cfg([str(corpus / "*")], train_shards=3)
    local = prepare(cfg, 400, tmp_path / "out", **QUIET)
    stats = prepare(cfg, 400, f"{memory}/out", **QUIET)
    assert stats == local
    published = tree(f"{memory}/out")
    assert published == tree(tmp_path / "out")
    assert sorted(published) == sorted(
        [s["name"] for s in stats["shards"]] + ["dead_letter.jsonl", "tokenizer/special_tokens.json", "tokenizer/tokenizer.json"]
    )
    for shard in stats["shards"]:
        assert hashlib.sha256(published[shard["name"]]).hexdigest() == shard["sha256"]
        with storage.download_to_temp(f"{memory}/out/{shard['name']}") as path:
            assert len(read_shard(path)) == shard["sequences"]
    # A rerun with fewer shards replaces the earlier ones.
    again = prepare(make_cfg([str(corpus / "*")], train_shards=2), 400, f"{memory}/out/", **QUIET)
    assert sorted(n for n in tree(f"{memory}/out") if n.endswith(".array_record")) == [s["name"] for s in again["shards"]]


def test_output_to_file_url_from_worker_processes(tmp_path):
    """The multi-processing runner: each worker process uploads its shards through fsspec."""
    corpus = write_corpus(tmp_path / "corpus", n=12, seed=13)
    cfg = make_cfg([f"file://{corpus}/*"], beam_args=["--direct_num_workers=2"])
    stats = prepare(cfg, 400, f"file://{tmp_path}/out", **QUIET)
    expected = prepare(make_cfg([str(corpus / "*")]), 400, tmp_path / "local", **QUIET)
    assert without_patterns(stats) == without_patterns(expected)
    assert tree(tmp_path / "out") == tree(tmp_path / "local")


def test_failure_mid_run_publishes_nothing(tmp_path, memory, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", n=12, seed=14)
    calls = []

    from data_prep import pipeline

    class FailingPacker(pipeline.PACKERS["concat"]):
        def __init__(self, seq_len):
            calls.append(1)
            if len(calls) > 1:  # after one shard has been uploaded to staging
                raise RuntimeError("worker died")
            super().__init__(seq_len)

    monkeypatch.setitem(pipeline.PACKERS, "concat", FailingPacker)
    with pytest.raises(Exception, match="worker died"):
        prepare(make_cfg([str(corpus / "*")]), 400, f"{memory}/out", **QUIET)
    assert calls and tree(f"{memory}/out") == {}
    monkeypatch.undo()
    with pytest.raises(UserError, match="train split is empty"):  # a failed check after the Beam run
        prepare(make_cfg([str(write_corpus(tmp_path / "one", n=1) / "*")]), 400, f"{memory}/out", **QUIET)
    assert tree(f"{memory}/out") == {}


def test_remote_runner_needs_urls(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n=4)
    with pytest.raises(UserError, match="give inputs and output as URLs"):
        prepare(make_cfg([str(corpus / "*")], beam_args=["--runner=DataflowRunner"]), 400, tmp_path / "out", **QUIET)
    assert not any((tmp_path / "out").iterdir())
