"""Mixture-of-Experts routing: the load-balancing loss against transformers' (on the same router logits, and on
an ingested model), dropless against capacity slots, dropped pairs counted, the CPU grouped matmul, active-parameter
FLOPs, expert-parallel memory, and training with MoE (bf16, remat, accumulation, metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from configs import load_config
from tests.trainer.hf_models import VOCAB, tiny_model
from tests.trainer.test_metrics import tensorboard_scalars
from tests.trainer.test_train_data import random_dataset, split_train
from trainer.model import routing as moe
from trainer.hf.config import model_config_from_hf, read_hf_config
from trainer.hf.ingest import load_hf_params
from trainer.train.metrics import train_flops_per_step
from trainer.model.decoder import Transformer
from trainer.train.loop import compile_only, train

MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.load_balance_weight=0.01"]


def _stats(logits: np.ndarray, mask: np.ndarray, k: int) -> dict:
    """Every layer's router statistics as the model sows them, for router logits [layers, tokens, experts]."""
    per_layer = []
    for layer in logits:
        _, experts, probs = moe.route(jnp.asarray(layer), k, renormalize=True)
        per_layer.append(moe.router_stats(experts, probs, jnp.asarray(mask)))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_load_balance_loss_equals_transformers(k: int) -> None:
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(3, 40, 6)).astype(np.float32)  # 3 layers, 2 sequences of 20 tokens, 6 experts
    mask = np.ones(40, np.float32)
    mask[15:20] = mask[33:] = 0  # right padding in both sequences
    for m in (None, mask):
        theirs = load_balancing_loss_func(
            tuple(torch.from_numpy(layer) for layer in logits), 6, k,
            None if m is None else torch.from_numpy(m.reshape(2, 20)),
        )
        ours = moe.load_balance_loss(_stats(logits, np.ones(40) if m is None else m, k))
        # The same float32 sums in another order.
        np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)


def test_tiled_grouped_matmul_equals_ragged_dot() -> None:
    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.normal(size=(200, 16)), jnp.float32), jnp.asarray(rng.normal(size=(5, 16, 24)), jnp.float32)
    sizes = jnp.asarray([70, 0, 3, 100, 27], jnp.int32)  # an empty group, groups smaller and larger than a tile

    def loss(matmul):
        return lambda x, w: jnp.sum(jnp.sin(matmul(x, w)))

    want = jax.jit(jax.value_and_grad(loss(lambda x, w: jax.lax.ragged_dot(x, w, sizes)), argnums=(0, 1)))(x, w)
    for tile in (1, 16, 64, 256):
        got = jax.jit(jax.value_and_grad(loss(lambda x, w: moe._tiled_matmul(x, w, sizes, tile)), argnums=(0, 1)))(x, w)
        # The same products; float32 sums in another order.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), got, want)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_ingested_model_balances_as_transformers_model_does(family: str, tmp_path: Path) -> None:
    hf_model = tiny_model(family)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = model_config_from_hf(read_hf_config(tmp_path / "hf"))
    tokens = np.random.default_rng(0).integers(1, VOCAB, (2, 64))
    mask = np.ones((2, 64), np.int64)
    mask[1, 40:] = 0  # the second sequence is right-padded
    with torch.no_grad():
        out = hf_model(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
    # transformers adds coef x load_balancing_loss_func(router logits, E, k, attention_mask) to its loss.
    theirs = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.experts_per_token, torch.tensor(mask))
    segment_ids = mask.astype(np.int32)  # padding is segment 0 in our batches
    _, state = Transformer(cfg).apply(
        {"params": load_hf_params(tmp_path / "hf", cfg)}, tokens, segment_ids=segment_ids, mutable=["intermediates"]
    )
    ours = moe.load_balance_loss(state["intermediates"]["moe"][0])
    # Float32 router logits from two implementations of the layers below them: a top-k choice could flip on
    # a near tie, which these random weights do not come near; the sums then differ in rounding only.
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-5)


def test_compile_only_reports_expert_parallel_memory() -> None:
    cfg = load_config("tiny", MOE + ["train.batch_size=16", "train.mesh={expert: 4, fsdp: 2}"])
    report = compile_only(cfg.model, cfg.train, 64, log=lambda _: None)
    assert report["mesh"] == {"data": 1, "fsdp": 2, "expert": 4, "context": 1, "tensor": 1}
    # float32 params and two Adam moments: 12 bytes a parameter, replicated they would all be on every device.
    # Experts split 4 ways (and fsdp 2), the rest 8 ways (embed over fsdp x expert): under a quarter of that.
    assert report["argument_bytes"] < 12 * report["parameters"] / 4


def _model(*overrides: str) -> Transformer:
    return Transformer(load_config("tiny", MOE + list(overrides)).model)


def test_capacity_slots_equal_dropless_routing_when_nothing_is_dropped() -> None:
    tokens = jax.random.randint(jax.random.key(0), (3, 24), 0, 512)
    dropless = _model()
    params = jax.jit(dropless.init)(jax.random.key(1), tokens)["params"]
    want = jax.jit(dropless.apply)({"params": params}, tokens)
    # capacity_factor E / k gives every expert a slot for each token of the sequence: nothing can drop.
    capacity = _model("model.capacity_factor=2.0")
    got, state = jax.jit(lambda p, t: capacity.apply(p, t, mutable=["intermediates"]))({"params": params}, tokens)
    assert float(jnp.sum(state["intermediates"]["moe"][0]["dropped"])) == 0
    # The same products summed in another order (grouped matmul against batched einsum).
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


def test_small_capacity_drops_the_pairs_past_each_experts_slots() -> None:
    rng = np.random.default_rng(0)
    batch, seq, k, n, d, f = 2, 12, 2, 4, 8, 16
    experts = np.stack([rng.permutation(n)[:k] for _ in range(batch * seq)]).reshape(batch, seq, k)
    weights = rng.random((batch, seq, k)).astype(np.float32)
    x = rng.normal(size=(batch, seq, d)).astype(np.float32)
    params = tuple(rng.normal(size=s).astype(np.float32) for s in ((n, d, f), (n, d, f), (n, f, d)))
    act = jax.nn.silu
    out, kept = moe.with_capacity(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), params, act, 0.5)

    slots = moe.capacity(seq, k, n, 0.5)  # 3 slots per expert and sequence for 24 pairs
    want_kept = np.zeros_like(experts, bool)
    want = np.zeros_like(x)
    gate, up, down = params
    for b in range(batch):
        used = np.zeros(n, int)
        for t in range(seq):  # slots go to pairs in token order
            for j, e in enumerate(experts[b, t]):
                used[e] += 1
                if used[e] <= slots:
                    want_kept[b, t, j] = True
                    h = np.asarray(act(x[b, t] @ gate[e])) * (x[b, t] @ up[e])
                    want[b, t] += weights[b, t, j] * (h @ down[e])
    np.testing.assert_array_equal(kept, want_kept)
    assert (~want_kept).sum() == 2 * (seq * k - n * slots)  # every slot full, the rest dropped
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

    valid = np.ones((batch, seq), bool)
    valid[:, -2:] = False  # padding takes slots too, but its drops are not counted
    stats = moe.router_stats(jnp.asarray(experts.reshape(-1, k)), jnp.ones((batch * seq, n)) / n, valid, kept)
    assert float(stats["dropped"]) == (~want_kept[:, :-2]).sum()


def test_flops_count_active_parameters() -> None:
    cfg = load_config("tiny", MOE + ["model.expert_mlp_dim=32"]).model
    dense = load_config("tiny", ["model.mlp_dim=64"]).model  # k x expert width: the same active MLP
    router = 3 * 2 * (2 * 8 * 64 * 64 * 4)  # forward + backward, 2 layers, the [64, 4] router on 8 x 64 tokens
    assert train_flops_per_step(cfg, 8, 64) == pytest.approx(train_flops_per_step(dense, 8, 64) + router)
    # MoE every second layer: one layer as the MoE model's, the other as the dense tiny model's.
    half = cfg.model_copy(update={"moe_every": 2})
    tiny = load_config("tiny").model
    want = (train_flops_per_step(cfg, 8, 64) + train_flops_per_step(tiny, 8, 64)) / 2
    assert train_flops_per_step(half, 8, 64) == pytest.approx(want)


def test_moe_training_in_bfloat16_with_remat_and_accumulation_logs_router_metrics(tmp_path: Path) -> None:
    data = random_dataset(tmp_path / "data", rows=32, seq_len=32, vocab=512)
    cfg = load_config("tiny", MOE + [
        "model.moe_every=2",  # a dense layer, then an MoE one: the scanned unit is the pair
        "model.dtype=bfloat16", "train.remat=full", "train.grad_accum_steps=2", "train.steps=4", "train.batch_size=16",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0", "train.mesh={expert: 4, fsdp: 2}",
    ])
    lines: list[str] = []
    summary = train(cfg.model, *split_train(cfg.train), data, tmp_path / "run", log=lines.append)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and np.isfinite(summary["final_loss"])
    assert summary["final_busiest_expert"] == pytest.approx(max(rows[-1]["expert_load"]) * 4)
    for row in rows:
        assert len(row["expert_load"]) == 4 and sum(row["expert_load"]) == pytest.approx(1.0)
        assert row["load_balance_loss"] >= 2.0 - 1e-3  # k = 2 when perfectly balanced, more otherwise
        assert row["dropped_fraction"] == 0.0
    assert any("balance_loss" in line and "busiest expert" in line for line in lines)
    assert [s for s, _ in tensorboard_scalars(tmp_path / "run" / "tensorboard")["load_balance_loss"]] == [1, 2, 3, 4]
