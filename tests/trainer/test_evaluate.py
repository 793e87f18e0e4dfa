"""Evaluation: validation loss against a direct computation, decoding against naive re-runs, the tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from jax.sharding import Mesh

from configs import UserError, load_config
from trainer.eval.evaluate import evaluate, generate
from trainer.train.loss import token_loss, validation_loss
from trainer.model.decoder import Transformer
from trainer.hf.tokenizer import load_tokenizer

SEQ_LEN = 32
VOCAB = 512


@pytest.fixture(scope="module")
def cfg():
    return load_config("tiny").model


@pytest.fixture(scope="module")
def params(cfg):
    return nn.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])


@pytest.fixture(scope="module")
def forward(cfg):
    """Jitted logits [seq, vocab] of one unpadded sequence."""
    apply = jax.jit(Transformer(cfg).apply)
    return lambda params, seq: np.asarray(apply({"params": params}, jnp.asarray([seq], jnp.int32))[0], np.float64)


PROMPT = [5, 17, 300, 2]
STEPS = 6


@pytest.fixture(scope="module")
def naive_greedy(params, forward) -> list[int]:
    """Argmax decoding by re-running the model on the whole growing sequence."""
    seq = list(PROMPT)
    for _ in range(STEPS):
        seq.append(int(np.argmax(forward(params, seq)[-1])))
    return seq[len(PROMPT) :]


def sequences(count: int, seed: int = 0) -> list[np.ndarray]:
    """Random records of SEQ_LEN tokens, each with a different number of -1 pads at the end."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        seq = rng.integers(0, VOCAB, SEQ_LEN, dtype=np.int32)
        seq[SEQ_LEN - (3 * i) % (SEQ_LEN - 2) :] = -1
        out.append(seq)
    return out


def write_shard(path: Path, records: list[np.ndarray]) -> str:
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(r.astype("<i4").tobytes())
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def reference_loss(cfg):
    """Mean CE over up to 8 records' real next-token pairs, with a numpy float64 log-softmax."""
    apply = jax.jit(Transformer(cfg).apply)

    def loss(params, records: list[np.ndarray]) -> tuple[float, int]:
        batch = np.full((8, SEQ_LEN), -1, np.int32)  # one shape, one compilation
        batch[: len(records)] = records
        logits = np.asarray(apply({"params": params}, jnp.asarray(np.maximum(batch, 0))), np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        pairs = (batch[:, :-1] != -1) & (batch[:, 1:] != -1)  # causal: pads right of a position don't affect it
        picked = np.take_along_axis(logp[:, :-1], np.maximum(batch[:, 1:], 0)[..., None], -1)[..., 0]
        return float(-picked[pairs].sum() / pairs.sum()), int(pairs.sum())

    return loss


def test_token_loss_counts_only_masked_positions():
    logits = jnp.array([[[0.0, 0.0], [5.0, -5.0], [jnp.nan, 0.0]]])
    total, count = token_loss(logits, jnp.array([[0, 0, 1]]), jnp.array([[1.0, 1.0, 0.0]]))
    assert float(count) == 2
    assert float(total) == pytest.approx(math.log(2) + math.log1p(math.exp(-10)), rel=1e-5)


def test_validation_loss_matches_direct_computation(tmp_path, cfg, params, reference_loss):
    records = sequences(5)
    paths = [
        write_shard(tmp_path / "val-00000.array_record", records[:3]),
        write_shard(tmp_path / "val-00001.array_record", records[3:]),
    ]
    want, count = reference_loss(params, records)
    for batch_size in (2, 5):  # 5 sequences in batches of 2: the last batch has a padding row
        got = validation_loss(params, cfg, paths, batch_size)
        assert got["loss"] == pytest.approx(want, rel=1e-5)
        assert got["tokens"] == count
        assert got["sequences"] == 5
        assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    # Random init predicts roughly uniformly.
    assert abs(want - math.log(VOCAB)) < 0.1


def test_validation_loss_max_batches_and_mesh(tmp_path, cfg, params, reference_loss):
    records = sequences(8, seed=1)
    paths = [write_shard(tmp_path / "val-00000.array_record", records)]
    first = validation_loss(params, cfg, paths, batch_size=2, max_batches=2)
    assert first["sequences"] == 4
    assert first["loss"] == pytest.approx(reference_loss(params, records[:4])[0], rel=1e-5)

    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2, 1), ("data", "fsdp", "tensor"))  # batch over data and fsdp
    sharded = validation_loss(params, cfg, paths, batch_size=8, mesh=mesh)
    assert sharded["loss"] == pytest.approx(reference_loss(params, records)[0], rel=1e-5)


def greedy(params, cfg, prompt=PROMPT, steps=STEPS, eos_id=None) -> list[int]:
    return generate(params, cfg, prompt, steps, temperature=0.0, top_k=0, seed=0, eos_id=eos_id)


def test_greedy_matches_naive_decoding(cfg, params, naive_greedy):
    assert greedy(params, cfg) == naive_greedy


def test_long_prompt_keeps_its_tail(cfg, params, forward):
    short = cfg.model_copy(update={"max_seq_len": 16})
    prompt = list(range(1, 21))
    got = greedy(params, short, prompt, 6)
    # Every new token is the argmax given the last 10 prompt tokens and the tokens before it.
    logits = forward(params, prompt[-10:] + got)
    assert len(got) == 6 and got == np.argmax(logits[9:15], -1).tolist()
    # Asking for more than fits: one prompt token stays, the rest of the window is generated.
    assert len(greedy(params, short, prompt, 40)) == 15


def test_generation_stops_at_eos(cfg, params, naive_greedy):
    assert greedy(params, cfg, eos_id=naive_greedy[0]) == []
    stop = naive_greedy.index(naive_greedy[2])
    assert greedy(params, cfg, eos_id=naive_greedy[2]) == naive_greedy[:stop]
    assert greedy(params, cfg, steps=0) == []


def test_sampling_is_seeded_and_top_k_limits_it(cfg, params, forward, naive_greedy):
    def sample(seed: int, top_k: int = 0) -> list[int]:
        return generate(params, cfg, PROMPT, STEPS, temperature=1.0, top_k=top_k, seed=seed, eos_id=None)

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)
    assert sample(7, top_k=1) == naive_greedy
    drawn = sample(5, top_k=3)
    logits = forward(params, PROMPT + drawn)[len(PROMPT) - 1 : -1]
    assert all(t in np.argsort(row)[-3:] for t, row in zip(drawn, logits))


def make_hf_tokenizer(directory: Path) -> None:
    """A tiny byte-level BPE, as prep would write it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n", "def hello():\n    print('hi')\n"] * 20, trainer)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    meta = {
        "kind": "hf", "vocab_size": tok.get_vocab_size(), "eos_id": 0, "eos_token": "<|endoftext|>",
        "bos_id": None, "bos_token": None,
    }
    (directory / "special_tokens.json").write_text(json.dumps(meta))


def test_hf_tokenizer_round_trips(tmp_path):
    make_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    text = "def add(x, y):\n    return x + y  # ünïcode ✓\n"
    ids = tok.encode(text)
    assert tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id, VOCAB + 5]) == text  # specials and padded-vocab ids are dropped
    assert tok.bos_id is None and tok.vocab_size <= 300


def test_sentencepiece_tokenizer_round_trips(tmp_path):
    import sentencepiece as spm

    directory = tmp_path / "tok"
    directory.mkdir()
    text = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"] * 50
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_prefix=str(directory / "tokenizer"), vocab_size=60,
        model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )
    meta = {"kind": "sentencepiece", "vocab_size": 60, "eos_id": 2, "eos_token": "</s>", "bos_id": 1, "bos_token": "<s>"}
    (directory / "special_tokens.json").write_text(json.dumps(meta))
    tok = load_tokenizer(directory)
    ids = tok.encode("the lazy fox")
    assert ids and tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "the lazy fox"
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 60)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "special_tokens.json").write_text(json.dumps({"kind": "hf", "vocab_size": 10, "eos_id": 0, "bos_id": None}))
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(UserError, match="unreadable tokenizer"):
        load_tokenizer(tmp_path)


def test_evaluate_end_to_end(tmp_path, cfg, params):
    make_hf_tokenizer(tmp_path / "tokenizer")
    records = sequences(3, seed=2)
    paths = [write_shard(tmp_path / "val-00000.array_record", records)]
    task = tmp_path / "arc_tiny.jsonl"
    task.write_text("\n".join(json.dumps(ex) for ex in [
        {"context": "def add(a, b):", "choices": ["\n    return a + b", " print('hi')"], "label": 0},
        {"context": "def hello():", "choices": [" pass", "\n    print('hi')", " 42"], "label": 1},
    ]))
    eval_cfg = load_config("tiny").eval.model_copy(
        update={"prompt": "def add", "max_new_tokens": 5, "temperature": 0.0, "tasks": [str(task)]}
    )
    lines: list[str] = []
    got = evaluate(params, cfg, eval_cfg, tmp_path, log=lines.append)
    assert set(got) == {"val_loss", "val_perplexity", "val_tokens", "prompt", "sample", "tasks"}
    assert got["tasks"][0]["task"] == "arc_tiny" and got["tasks"][0]["examples"] == 2
    assert "task arc_tiny: accuracy" in lines[-1]
    lines = lines[:-1]
    assert got["val_loss"] == pytest.approx(validation_loss(params, cfg, paths, 8, 4)["loss"])
    tok = load_tokenizer(tmp_path / "tokenizer")
    ids = generate(params, cfg, tok.encode("def add"), 5, 0.0, 0, 0, tok.eos_id)
    assert got["sample"] == tok.decode(ids) and got["prompt"] == "def add"
    assert len(lines) == 2 and "val loss" in lines[0]

    with pytest.raises(UserError, match="model.vocab_size"):
        evaluate(params, cfg.model_copy(update={"vocab_size": 100}), eval_cfg, tmp_path, log=lines.append)


def test_loss_step_keeps_packed_documents_apart(cfg, params):
    """A batch with segment_ids/positions (document packing) scores each document as if it were alone."""
    from trainer.train.loss import _loss_step

    rng = np.random.default_rng(4)
    a, b = rng.integers(0, VOCAB, 20), rng.integers(0, VOCAB, 12)
    step = _loss_step(cfg.model_dump_json())

    def batch(tokens, segments, positions, n_targets):
        inputs = np.asarray(tokens, np.int32)[None]
        targets = np.roll(inputs, -1, axis=1)
        mask = np.zeros_like(inputs, np.float32)
        for start, stop in n_targets:
            mask[0, start:stop] = 1
        out = {"inputs": inputs, "targets": targets, "mask": mask}
        if segments is not None:
            out |= {"segment_ids": np.asarray([segments], np.int32), "positions": np.asarray([positions], np.int32)}
        return out

    packed = batch(np.concatenate([a, b]), [1] * 20 + [2] * 12, list(range(20)) + list(range(12)), [(0, 19), (20, 31)])
    alone = [batch(a, None, None, [(0, 19)]), batch(b, None, None, [(0, 11)])]
    total, count, _ = step(params, packed)
    want = sum(float(step(params, x)[0]) for x in alone)
    assert float(count) == 30 and float(total) == pytest.approx(want, rel=1e-5)
    unpacked = {k: v for k, v in packed.items() if k not in ("segment_ids", "positions")}
    assert float(step(params, unpacked)[0]) != pytest.approx(want, rel=1e-3)  # without them, b sees a
