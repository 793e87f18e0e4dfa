"""Multiple-choice tasks (HellaSwag/ARC style) scored by the log-likelihood of each choice given the context.

A task is a local JSON-lines file, one example a line: {"context": str, "choices": [str, ...], "label": int}.
Accuracy picks the choice with the highest summed log-likelihood; normalised accuracy divides it by the
choice's length in characters first (as lm-evaluation-harness's acc_norm).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import ModelConfig, UserError
from trainer.model.decoder import Transformer
from trainer.hf.tokenizer import Tokenizer

Array = jax.Array


def load_task(path: str | Path) -> list[dict]:
    """The examples of a JSON-lines task file, checked: each has a context, two or more choices and a valid label."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"eval.tasks: no task file at {path}")
    examples = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{n}: not valid JSON ({err})") from None
        ok = (
            isinstance(ex, dict) and isinstance(ex.get("context"), str) and isinstance(ex.get("choices"), list)
            and len(ex["choices"]) >= 2 and all(isinstance(c, str) and c for c in ex["choices"])
            and isinstance(ex.get("label"), int) and 0 <= ex["label"] < len(ex["choices"])
        )
        if not ok:
            raise UserError(
                f'{path}:{n}: expected {{"context": str, "choices": [two or more non-empty str], "label": index}}'
            )
        examples.append(ex)
    if not examples:
        raise UserError(f"{path}: the task file has no examples")
    return examples


@functools.cache
def _score_step(cfg_json: str) -> Callable:
    """One jitted (params, tokens, mask) -> per-row summed log-likelihood of the masked next tokens."""
    model = Transformer(ModelConfig.model_validate_json(cfg_json))

    @jax.jit
    def step(params: Any, tokens: Array, mask: Array) -> Array:
        logits = model.apply({"params": params}, tokens)[:, :-1]
        logp = -optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return jnp.sum(jnp.where(mask[:, 1:], logp, 0.0), axis=-1)

    return step


def continuation_logprobs(
    params: Any, cfg: ModelConfig, requests: list[tuple[list[int], list[int]]], batch_size: int = 8
) -> list[float]:
    """log p(continuation | context) per (context ids, continuation ids); the context's head is cut to fit max_seq_len."""
    step = _score_step(cfg.model_dump_json())
    rows = []
    for context, cont in requests:
        if not context or not cont:
            raise ValueError("each request needs at least one context and one continuation token")
        seq = (list(context) + list(cont))[-cfg.max_seq_len:]
        rows.append((seq, len(seq) - len(cont)))
    longest = max(len(seq) for seq, _ in rows)
    width = min(-(-longest // 64) * 64, cfg.max_seq_len)  # pad to a multiple of 64: few compilations
    out = []
    for i in range(0, len(rows), batch_size):
        tokens = np.zeros((batch_size, width), np.int32)
        mask = np.zeros((batch_size, width), bool)
        for r, (seq, start) in enumerate(rows[i:i + batch_size]):
            tokens[r, : len(seq)] = seq
            mask[r, max(start, 1) : len(seq)] = True  # the first token has no prediction
        out.extend(np.asarray(step(params, jnp.asarray(tokens), jnp.asarray(mask)))[: len(rows[i:i + batch_size])].tolist())
    return out


def score_task(
    params: Any, cfg: ModelConfig, tokenizer: Tokenizer, path: str | Path, batch_size: int = 8
) -> dict[str, Any]:
    """{"task", "examples", "accuracy", "accuracy_norm"} of a multiple-choice JSON-lines file."""
    examples = load_task(path)
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    requests = []
    for k, ex in enumerate(examples):
        context = bos + tokenizer.encode(ex["context"])
        for choice in ex["choices"]:
            cont = tokenizer.encode(choice)
            if not cont:
                raise UserError(f"{path}: example {k + 1} has a choice that encodes to no tokens: {choice!r}")
            requests.append((context or [tokenizer.eos_id], cont))
    scores = continuation_logprobs(params, cfg, requests, batch_size)
    correct = correct_norm = 0
    pos = 0
    for ex in examples:
        n = len(ex["choices"])
        ll = np.asarray(scores[pos : pos + n])
        pos += n
        lengths = np.asarray([len(c) for c in ex["choices"]])
        correct += int(np.argmax(ll) == ex["label"])
        correct_norm += int(np.argmax(ll / lengths) == ex["label"])
    return {
        "task": Path(path).stem,
        "examples": len(examples),
        "accuracy": correct / len(examples),
        "accuracy_norm": correct_norm / len(examples),
    }
