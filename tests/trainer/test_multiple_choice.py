"""Multiple-choice scoring against transformers' log-probabilities on the same tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from configs import UserError
from tests.trainer.hf_models import tiny_model
from trainer.hf.config import model_config_from_hf, read_hf_config
from trainer.hf.ingest import load_hf_params
from trainer.eval.multiple_choice import continuation_logprobs, load_task, score_task
from trainer.hf.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    model = tiny_model("llama")
    model.save_pretrained(path)
    cfg = model_config_from_hf(read_hf_config(path))
    return model, cfg, load_hf_params(path, cfg)


def _hf_logprob(model, context: list[int], cont: list[int]) -> float:
    ids = torch.tensor([context + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return float(sum(logp[len(context) - 1 + i, t] for i, t in enumerate(cont)))


def test_continuation_logprobs_match_transformers(hf):
    model, cfg, params = hf
    rng = np.random.default_rng(0)
    requests = [(rng.integers(1, 512, n).tolist(), rng.integers(1, 512, m).tolist()) for n, m in ((250, 5), (3, 1), (100, 17))]
    got = continuation_logprobs(params, cfg, requests, batch_size=2)  # a padded last batch too
    want = [_hf_logprob(model, c, x) for c, x in requests]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The cat sat on the mat. A dog ran in the park.\n"] * 30, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "special_tokens.json").write_text(json.dumps(
        {"kind": "hf", "vocab_size": tok.get_vocab_size(), "eos_id": 0, "eos_token": "<|endoftext|>", "bos_id": None}
    ))
    return load_tokenizer(path)


def test_score_task_accuracy_and_length_normalisation(hf, tmp_path):
    model, cfg, params = hf
    tok = _tokenizer(tmp_path / "tok")
    rng = np.random.default_rng(1)
    words = ["cat", "dog", "mat", "park", "sat on the mat", "ran", "in the park today", "a"]
    examples = [
        {"context": "The cat sat on the " + " ".join(rng.choice(words, 3)),
         "choices": [" " + w for w in rng.choice(words, 4, replace=False)], "label": int(rng.integers(4))}
        for _ in range(12)
    ]
    path = tmp_path / "hellaswag_tiny.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in examples) + "\n")
    got = score_task(params, cfg, tok, path, batch_size=8)

    acc = acc_norm = 0
    for ex in examples:
        ctx = tok.encode(ex["context"])
        ll = np.array([_hf_logprob(model, ctx, tok.encode(c)) for c in ex["choices"]])
        acc += int(np.argmax(ll) == ex["label"])
        acc_norm += int(np.argmax(ll / [len(c.encode()) for c in ex["choices"]]) == ex["label"])
    assert got == {"task": "hellaswag_tiny", "examples": 12, "accuracy": acc / 12, "accuracy_norm": acc_norm / 12}


@pytest.mark.parametrize("line, message", [
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ('{"context": "x", "choices": ["a", "b"], "label": 2}', r"bad\.jsonl:2: expected"),
    ('{"context": "x", "choices": ["a"], "label": 0}', r"bad\.jsonl:2: expected"),
])
def test_bad_task_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "x", "choices": ["a", "b"], "label": 1}\n' + line + "\n")
    with pytest.raises(UserError, match=message):
        load_task(path)
    with pytest.raises(UserError, match="no task file"):
        load_task(tmp_path / "missing.jsonl")
