"""Eval forward throughput against the training step's, on the same model and batch shape.

    python benchmarks/eval_throughput.py [PRESET] [key=value ...]      (default preset: demo)

Times the eval step's jitted loss (trainer.eval.evaluate, forward only) and the train step
(trainer.train.loop.make_train_step: forward, backward, optimizer update) on random token batches of
train.batch_size x data.seq_len, compilation excluded, median of repeated runs. The anchor is the
train step's tokens/s; goal: eval >= 2x. Also times KV-cache decoding (tokens/s of new tokens).
Record the output in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    from configs import load_config
    from trainer.eval.decode import generate_batch
    from trainer.train.loss import _loss_step
    from trainer.model.decoder import Transformer, param_count
    from trainer.train.optimizer import make_optimizer
    from trainer.train.loop import make_train_step

    preset = argv[0] if argv and "=" not in argv[0] else None
    cfg = load_config(preset, argv[1:] if preset else argv)
    model_cfg, batch, seq = cfg.model, cfg.train.batch_size, cfg.data.seq_len
    model = Transformer(model_cfg)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))["params"])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model_cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
    data = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "mask": jnp.ones((batch, seq), jnp.float32)}
    print(f"model {model_cfg.name} ({model_cfg.family}, {param_count(params) / 1e6:.1f} M params), batch {batch} x {seq}, "
          f"{jax.devices()[0].platform}")

    loss = _loss_step(model_cfg.model_dump_json())
    eval_s = _median_seconds(lambda: loss(params, data), 7)

    tx = make_optimizer(cfg.train)
    step = make_train_step(model, tx)
    state = {"params": jax.tree.map(jnp.copy, params)}
    state["opt"] = jax.jit(tx.init)(state["params"])

    def train_once():
        state["params"], state["opt"], out = step(state["params"], state["opt"], data)
        return out["loss"]

    train_s = _median_seconds(train_once, 5)
    n = batch * seq
    print(f"train step    {train_s * 1e3:8.1f} ms = {n / train_s:10,.0f} tokens/s (anchor)")
    print(f"eval forward  {eval_s * 1e3:8.1f} ms = {n / eval_s:10,.0f} tokens/s = {train_s / eval_s:.2f} x train (goal >= 2)")

    prompts = [rng.integers(1, model_cfg.vocab_size, 64).tolist() for _ in range(8)]
    generate_batch(params, model_cfg, prompts, 64)
    start = time.perf_counter()
    generate_batch(params, model_cfg, prompts, 64)
    gen_s = time.perf_counter() - start
    print(f"KV-cache decode (8 prompts x 64 tokens, then 64 new each, greedy) {gen_s:.2f} s = {8 * 64 / gen_s:,.0f} new tokens/s")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
