"""Batched autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling, stop at EOS.

Prompts are left-padded to one length so every row writes its next token into the same cache slot;
padding slots hold position -1 and are masked out, so a row's tokens do not depend on its padding.
The cache keeps every position, sliding-window layers included (they mask, they do not evict).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from configs import ModelConfig
from trainer.model.decoder import Transformer, init_cache

Array = jax.Array


def sample_logits(logits: Array, key: Array, temperature: Array, top_k: Array, top_p: Array) -> Array:
    """Next tokens [batch] from logits [batch, vocab]: argmax when temperature is 0, else temperature -> top-k -> top-p."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    kth = jnp.where(top_k > 0, ordered[:, jnp.clip(top_k, 1, logits.shape[-1]) - 1], -jnp.inf)
    ordered = jnp.where(ordered < kth[:, None], -jnp.inf, ordered)
    # Nucleus: keep the most likely tokens while the mass before them is below top_p (the first always stays).
    probs = jax.nn.softmax(ordered, axis=-1)
    keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p) | (top_p >= 1.0)  # 1.0 keeps all: float32 sums round
    cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1)
    scaled = jnp.where(scaled < jnp.maximum(kth, cutoff)[:, None], -jnp.inf, scaled)
    sampled = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.cache
def _decode_loop(cfg_json: str) -> Callable:
    """One jitted decode per model config; it compiles once per (batch, prompt length, new tokens) shape."""
    cfg = ModelConfig.model_validate_json(cfg_json)
    model = Transformer(cfg)

    @jax.jit
    def decode(params: Any, prompts: Array, lengths: Array, limits: Array, out: Array, eos_id: Array,
               temperature: Array, top_k: Array, top_p: Array, key: Array) -> Array:
        batch, plen = prompts.shape
        positions = jnp.arange(plen)[None, :] - (plen - lengths)[:, None]
        positions = jnp.where(positions >= 0, positions, -1)
        cache = init_cache(cfg, batch, plen + out.shape[1])
        logits, cache = model.apply({"params": params}, prompts, positions, cache=cache)

        def step_fn(state: tuple) -> tuple:
            step, logits, cache, out, done = state
            token = sample_logits(logits, jax.random.fold_in(key, step), temperature, top_k, top_p)
            out = out.at[:, step].set(token)
            done = done | (token == eos_id) | (step + 1 >= limits)
            logits, cache = model.apply({"params": params}, token[:, None], (lengths + step)[:, None], cache=cache)
            return step + 1, logits[:, 0], cache, out, done

        def not_done(state: tuple) -> Array:
            return (state[0] < out.shape[1]) & ~jnp.all(state[4])

        state = (jnp.int32(0), logits[:, -1], cache, out, limits <= 0)
        return jax.lax.while_loop(not_done, step_fn, state)[3]

    return decode


def generate_batch(
    params: Any,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[list[int]]:
    """New token ids per prompt, up to max_new_tokens or EOS (not included); greedy when temperature is 0.

    A prompt longer than fits keeps its tail so prompt + new tokens fit in cfg.max_seq_len (one token at least).
    """
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate needs at least one prompt token per prompt")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    tails = [list(p)[-max(cfg.max_seq_len - max_new_tokens, 1):] for p in prompts]
    lengths = np.array([len(t) for t in tails], np.int32)
    limits = np.minimum(max_new_tokens, cfg.max_seq_len - lengths).astype(np.int32)
    padded = np.zeros((len(tails), lengths.max()), np.int32)
    for row, tail in zip(padded, tails):
        row[len(row) - len(tail):] = tail
    out = _decode_loop(cfg.model_dump_json())(
        params, jnp.asarray(padded), jnp.asarray(lengths), jnp.asarray(limits),
        jnp.zeros((len(tails), int(limits.max())), jnp.int32), jnp.int32(-1 if eos_id is None else eos_id),
        jnp.float32(temperature), jnp.int32(min(top_k, cfg.vocab_size)), jnp.float32(top_p), jax.random.key(seed),
    )
    results = []
    for row, limit in zip(np.asarray(out).tolist(), limits):
        row = row[:limit]  # past a row's limit or EOS the loop may have run on for other rows
        results.append(row[: row.index(eos_id)] if eos_id in row else row)
    return results
