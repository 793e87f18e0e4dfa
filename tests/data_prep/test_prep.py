"""The prep step end to end on small corpora, checked against the tokenizer's own output."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from configs import DataConfig, UserError
from contract.records import PAD
from data_prep import read_shard
from tests.helpers import prepare

FAST = ["--direct_running_mode=in_memory", "--direct_num_workers=1"]
WORDS = "def class return import for while if else lambda yield self None True 0 1 42 é 中文 🙂 ( ) : , = + \n \n    ".split(" ")


def write_corpus(folder: Path, n: int = 24, seed: int = 0) -> Path:
    """n small text documents of varied length (incl. non-ASCII), as .py and .txt files."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 300)))
        (folder / f"doc{i:03d}.{'py' if i % 2 else 'txt'}").write_text(text, encoding="utf-8")
    return folder


def make_cfg(inputs: list[str], **overrides) -> DataConfig:
    fields = dict(
        input=inputs, weights=[], text_field="text", max_document_bytes=8_000_000, max_bad_fraction=0.05, dedup=True,
        packing="concat", tokenizer="", seq_len=32, val_fraction=0.2, train_shards=2, val_shards=1,
        bpe_train_max_bytes=10**6, beam_args=FAST,
    )
    return DataConfig(**{**fields, **overrides})


def documents(paths: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(paths)]


def shard_streams(out: Path, stats: dict) -> dict[str, np.ndarray]:
    """Each shard's token stream with the trailing pads removed; checks pads are only at the end."""
    streams = {}
    seq_len = stats["seq_len"]
    for shard in stats["shards"]:
        rows = read_shard(out / shard["name"])
        assert len(rows) == shard["sequences"]
        if not len(rows):
            streams[shard["name"]] = np.zeros(0, np.int32)
            continue
        assert rows.shape[1] == seq_len and rows.dtype == np.dtype("<i4")
        flat = rows.reshape(-1)
        n = int((flat != PAD).sum())
        assert (flat[:n] != PAD).all() and (flat[n:] == PAD).all() and len(flat) - n < seq_len
        streams[shard["name"]] = flat[:n]
    return streams


def split_docs(stream: np.ndarray, eos: int) -> list[tuple[int, ...]]:
    """A shard's stream cut after each EOS (every document ends with one)."""
    ends = np.flatnonzero(stream == eos)
    assert len(stream) == 0 or ends[-1] == len(stream) - 1
    return [tuple(d) for d in np.split(stream, ends + 1)[:-1]]


def check_lossless(out: Path, stats: dict, texts: list[str], encode) -> None:
    """Shards hold exactly each document's ids + EOS, whole and in order, and the stats agree."""
    special = json.loads((out / "tokenizer" / "special_tokens.json").read_text())
    expected = sorted(tuple(encode(t)) + (special["eos_id"],) for t in texts)
    streams = shard_streams(out, stats)
    got = sorted(d for s in streams.values() for d in split_docs(s, special["eos_id"]))
    assert got == expected
    assert sum(stats["tokens"].values()) == sum(len(d) for d in expected) == sum(len(s) for s in streams.values())
    assert sum(stats["documents"].values()) == len(texts)
    for shard in stats["shards"]:
        data = (out / shard["name"]).read_bytes()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest() and shard["bytes"] == len(data)
        assert shard["tokens"] == len(streams[shard["name"]])
    assert stats["documents"]["val"] >= 1 and stats["tokens"]["val"] > 0


def test_trained_bpe_default_runner_is_lossless(tmp_path):
    """The default multi-processing DirectRunner; token counts equal the trained tokenizer's own output."""
    corpus = write_corpus(tmp_path / "corpus")
    cfg = make_cfg([str(corpus / "*.py"), str(corpus / "*.txt")], beam_args=[])
    lines = []
    stats = prepare(cfg, 400, tmp_path / "out", log=lines.append)
    out = tmp_path / "out"
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    texts = documents(list(corpus.iterdir()))
    check_lossless(out, stats, texts, lambda t: tok.encode(t).ids)
    # Within a shard, documents follow their source path.
    path_of = {tuple(tok.encode(p.read_text(encoding="utf-8")).ids) + (0,): p for p in corpus.iterdir()}
    for stream in shard_streams(out, stats).values():
        paths = [path_of[doc] for doc in split_docs(stream, 0)]
        assert paths == sorted(paths)
    assert tok.decode(tok.encode(texts[0]).ids) == texts[0]  # byte-level: lossless text round trip
    special = json.loads((out / "tokenizer" / "special_tokens.json").read_text())
    assert special == {
        "kind": "hf", "vocab_size": tok.get_vocab_size(), "eos_id": 0, "eos_token": "<|endoftext|>",
        "bos_id": None, "bos_token": None, "prepend_bos": False, "append_eos": True,
    }
    assert stats["tokenizer"]["vocab_size"] <= 400 and stats["tokenizer"]["source"] == "trained:byte-level-bpe"
    assert stats["tokenizer"]["sha256"] == hashlib.sha256((out / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    assert [s["name"] for s in stats["shards"]] == [
        "train-00000-of-00002.array_record", "train-00001-of-00002.array_record", "val-00000-of-00001.array_record"
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted([s["name"] for s in stats["shards"]] + ["dead_letter.jsonl", "tokenizer"])
    assert stats["input"]["files"] == 24 and stats["skipped"] == {} and (out / "dead_letter.jsonl").read_text() == ""
    assert stats["record_format"] == {"dtype": "int32le", "pad": -1, "packing": "concat", "fields": ["tokens"], "seq_len": 32}
    assert stats["bad_records"] == {"records": 24, "count": 0, "fraction": 0.0, "max_fraction": 0.05, "file": "dead_letter.jsonl"}
    assert stats["duplicates"] == 0 and stats["mixture"] == [
        {"input": pattern, "weight": 1.0, "files": 12, "documents_read": 12, "duplicates": 0,
         "train_documents": sum(m["train_documents"] for m in stats["mixture"] if m["input"] == pattern),
         "train_tokens": sum(m["train_tokens"] for m in stats["mixture"] if m["input"] == pattern),
         "val_documents": sum(m["val_documents"] for m in stats["mixture"] if m["input"] == pattern),
         "val_tokens": sum(m["val_tokens"] for m in stats["mixture"] if m["input"] == pattern)}
        for pattern in cfg.input
    ]
    assert sum(m["train_tokens"] for m in stats["mixture"]) == stats["tokens"]["train"]
    json.dumps(stats)  # serialisable
    assert any("BPE" in line for line in lines) and any("tokens/s" in line for line in lines)


def test_shards_read_with_grain(tmp_path):
    """Grain's ArrayRecord source (the trainer's loader) reads every record, group_size 1."""
    grain = pytest.importorskip("grain")
    cfg = make_cfg([str(write_corpus(tmp_path / "corpus") / "*")])
    stats = prepare(cfg, 400, tmp_path / "out", log=lambda _: None)
    paths = [str(tmp_path / "out" / s["name"]) for s in stats["shards"] if s["split"] == "train"]
    source = grain.sources.ArrayRecordDataSource(paths)
    assert len(source) == stats["sequences"]["train"]
    assert np.frombuffer(source[len(source) - 1], "<i4").shape == (cfg.seq_len,)


def given_tokenizer(corpus: Path, path: Path, specials: list[str], post: processors.PostProcessor | None = None) -> Tokenizer:
    """A tokenizer trained here, independently of data_prep (whitespace BPE, not byte-level)."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(documents(list(corpus.iterdir())), trainers.BpeTrainer(vocab_size=150, special_tokens=["[UNK]", *specials]))
    if post is not None:
        tok.post_processor = post
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def test_given_tokenizer_json_is_lossless(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", seed=1)
    tok = given_tokenizer(corpus, tmp_path / "tok" / "tokenizer.json", ["<|endoftext|>"])
    cfg = make_cfg([str(corpus / "*")], tokenizer=str(tmp_path / "tok" / "tokenizer.json"), train_shards=3)
    stats = prepare(cfg, 1000, tmp_path / "out", log=lambda _: None)
    texts = documents(list(corpus.iterdir()))
    check_lossless(tmp_path / "out", stats, texts, lambda t: tok.encode(t).ids)
    assert sum(stats["tokens"].values()) == sum(len(tok.encode(t).ids) + 1 for t in texts)
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    assert stats["tokenizer"]["eos_id"] == tok.token_to_id("<|endoftext|>") and stats["tokenizer"]["bos_id"] is None


def test_model_folder_tokenizer_bos_is_not_doubled(tmp_path):
    """A HF model folder whose post-processor adds BOS: each document starts with exactly one BOS."""
    corpus = write_corpus(tmp_path / "corpus", n=10, seed=2)
    model = tmp_path / "hf_model"
    post = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = given_tokenizer(corpus, model / "tokenizer.json", ["<s>", "</s>"], post)
    assert tok.token_to_id("<s>") == 1
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    cfg = make_cfg([str(corpus / "*")], tokenizer=str(model))
    stats = prepare(cfg, 1000, tmp_path / "out", log=lambda _: None)
    check_lossless(tmp_path / "out", stats, documents(list(corpus.iterdir())), lambda t: tok.encode(t).ids)
    special = json.loads((tmp_path / "out" / "tokenizer" / "special_tokens.json").read_text())
    assert (special["bos_id"], special["eos_id"], special["prepend_bos"]) == (1, 2, False)
    streams = shard_streams(tmp_path / "out", stats)
    for stream in streams.values():
        for doc in split_docs(stream, 2):
            assert doc[0] == 1 and doc.count(1) == 1


def test_bare_tokenizer_json_bos_is_prepended(tmp_path):
    """No post-processor, no config: `<s>`/`</s>` are recognised and prep frames each document itself."""
    corpus = write_corpus(tmp_path / "corpus", n=10, seed=3)
    tok = given_tokenizer(corpus, tmp_path / "tokenizer.json", ["<s>", "</s>"])
    cfg = make_cfg([str(corpus / "*")], tokenizer=str(tmp_path / "tokenizer.json"))
    stats = prepare(cfg, 1000, tmp_path / "out", log=lambda _: None)
    check_lossless(tmp_path / "out", stats, documents(list(corpus.iterdir())), lambda t: [1] + tok.encode(t).ids)
    special = json.loads((tmp_path / "out" / "tokenizer" / "special_tokens.json").read_text())
    assert (special["bos_token"], special["eos_token"], special["prepend_bos"]) == ("<s>", "</s>", True)


def test_sentencepiece_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = write_corpus(tmp_path / "corpus", n=30, seed=4)
    texts = documents(list(corpus.iterdir()))
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(tmp_path / "sp"), vocab_size=60, model_type="bpe",
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    cfg = make_cfg([str(corpus / "*")], tokenizer=str(tmp_path / "sp.model"))
    stats = prepare(cfg, 64, tmp_path / "out", log=lambda _: None)
    check_lossless(tmp_path / "out", stats, texts, lambda t: [sp.bos_id()] + sp.encode(t))
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()
    assert stats["tokenizer"]["kind"] == "sentencepiece" and stats["tokenizer"]["bos_id"] == sp.bos_id()


def test_deterministic_across_runs_and_runners(tmp_path):
    """Same inputs and config: byte-identical shards and tokenizer, whichever DirectRunner mode."""
    corpus = write_corpus(tmp_path / "corpus", n=40, seed=5)
    runs = []
    for i, args in enumerate([FAST, FAST, ["--direct_running_mode=multi_threading", "--direct_num_workers=2"]]):
        out = tmp_path / f"out{i}"
        stats = prepare(make_cfg([str(corpus / "*")], beam_args=args, train_shards=3), 500, out, log=lambda _: None)
        files = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
        runs.append((stats, files))
    assert runs[0] == runs[1] == runs[2]


def test_rerun_replaces_earlier_shards(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n=12, seed=6)
    prepare(make_cfg([str(corpus / "*")], train_shards=3), 500, tmp_path / "out", log=lambda _: None)
    stats = prepare(make_cfg([str(corpus / "*")], train_shards=2), 500, tmp_path / "out", log=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.array_record")) == [s["name"] for s in stats["shards"]]


def test_jsonl_documents_and_skips(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [
        json.dumps({"text": "first document with some words", "id": 1}),
        "{not json",
        json.dumps({"body": "no text field"}),
        "",
        json.dumps({"text": "   "}),
        json.dumps({"text": "second document, ünïcode ✓"}),
        json.dumps([1, 2]),
        json.dumps({"text": "third document\nwith a newline"}),
    ]
    (corpus / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (corpus / "b.txt").write_text("a plain text document", encoding="utf-8")
    (corpus / "bad.txt").write_bytes(b"latin-1 \xe9\xe8 is not UTF-8")
    (corpus / "empty.txt").write_text("\n\n")
    (corpus / "c.jsonl").write_bytes(json.dumps({"text": "fourth"}).encode() + b"\n\xff\xfe broken\n")
    stats = prepare(make_cfg([str(corpus / "*")], val_fraction=0.5, max_bad_fraction=1), 400, tmp_path / "out", log=lambda _: None)
    assert stats["skipped"] == {"bad_json": 1, "empty": 3, "invalid_utf8": 2, "missing_text_field": 2}
    assert sum(stats["documents"].values()) == 5
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer" / "tokenizer.json"))
    texts = ["first document with some words", "second document, ünïcode ✓", "third document\nwith a newline",
             "a plain text document", "fourth"]
    check_lossless(tmp_path / "out", stats, texts, lambda t: tok.encode(t).ids)


def test_val_is_never_empty(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n=5, seed=7)
    stats = prepare(make_cfg([str(corpus / "*")], val_fraction=1e-9, val_shards=2), 400, tmp_path / "out", log=lambda _: None)
    assert stats["documents"] == {"train": 4, "val": 1}
    assert stats["tokens"]["val"] > 0 and stats["sequences"]["val"] >= 1
    # The empty val shard is still written (every shard of the config exists).
    assert sorted(s["sequences"] == 0 for s in stats["shards"] if s["split"] == "val") == [False, True]


def assert_nothing_written(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


def test_no_matching_input(tmp_path):
    with pytest.raises(UserError, match="no input files match"):
        prepare(make_cfg([str(tmp_path / "nothing" / "*.txt")]), 400, tmp_path / "out", log=lambda _: None)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("given", [False, True])
def test_empty_corpus(tmp_path, given):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("  \n")
    (corpus / "b.jsonl").write_text('{"text": ""}\n')
    tokenizer = ""
    if given:
        tokenizer = str(tmp_path / "tokenizer.json")
        given_tokenizer(write_corpus(tmp_path / "other", n=4), Path(tokenizer), ["<|endoftext|>"])
    with pytest.raises(UserError, match="empty corpus"):
        prepare(make_cfg([str(corpus / "*")], tokenizer=tokenizer), 400, tmp_path / "out", log=lambda _: None)
    assert_nothing_written(tmp_path / "out")


def test_corpus_without_tokens(tmp_path):
    """A tokenizer that finds nothing in the text (its normalizer deletes every letter)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("abc def")
    (corpus / "b.txt").write_text("xyz")
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Replace(Regex("[a-z]"), "")
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="yields no tokens"):
        prepare(make_cfg([str(corpus / "*")], tokenizer=str(tmp_path / "tokenizer.json")), 400, tmp_path / "out", log=lambda _: None)
    assert_nothing_written(tmp_path / "out")


def test_single_document_leaves_train_empty(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n=1)
    with pytest.raises(UserError, match="train split is empty"):
        prepare(make_cfg([str(corpus / "*")]), 400, tmp_path / "out", log=lambda _: None)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("kind", ["missing", "garbage_json", "garbage_model", "empty_folder"])
def test_bad_tokenizer_path(tmp_path, kind):
    corpus = write_corpus(tmp_path / "corpus", n=4)
    path = {"missing": tmp_path / "nope" / "tokenizer.json", "garbage_json": tmp_path / "tokenizer.json",
            "garbage_model": tmp_path / "sp.model", "empty_folder": tmp_path / "folder"}[kind]
    if kind.startswith("garbage"):
        path.write_text("this is not a tokenizer")
    if kind == "empty_folder":
        path.mkdir()
    with pytest.raises(UserError, match=str(path)):
        prepare(make_cfg([str(corpus / "*")], tokenizer=str(path)), 400, tmp_path / "out", log=lambda _: None)
    assert_nothing_written(tmp_path / "out")


def test_tokenizer_vocab_larger_than_model(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n=6)
    tok = given_tokenizer(corpus, tmp_path / "tokenizer.json", ["<|endoftext|>"])
    n = tok.get_vocab_size()
    with pytest.raises(UserError, match=rf"has {n} tokens, more than model.vocab_size \({n - 1}\)"):
        prepare(make_cfg([str(corpus / "*")], tokenizer=str(tmp_path / "tokenizer.json")), n - 1, tmp_path / "out", log=lambda _: None)
    assert_nothing_written(tmp_path / "out")
    with pytest.raises(UserError, match=r"model.vocab_size \(200\) is too small for a byte-level BPE"):
        prepare(make_cfg([str(corpus / "*")]), 200, tmp_path / "out", log=lambda _: None)
    assert_nothing_written(tmp_path / "out")
