"""Dropless MoE by all-to-all over the expert axis (trainer/model/expert_parallel.py): equal to the one-device
grouped matmul in value and gradients, a bounded receive buffer drops and counts exactly the pairs past it, a whole
train step equals one device's, and on TPU it compiles to ragged all-to-alls without gathering the tokens."""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import load_config
from trainer.model import expert_parallel, routing
from trainer.model.mlp import gated
from trainer.model.sharding import batch_sharding, make_mesh, use_mesh
from trainer.train.loop import abstract_params, init_opt_state, init_params, make_model, make_train_step
from trainer.train.optimizer import make_optimizer

B, S, D, F, E, K = 8, 16, 16, 32, 8, 2  # 8 sequences of 16 tokens: one sequence per device of an 8-device mesh


glu = gated(load_config("tiny", ["model.activation=silu_clamped"]).model)  # GPT-OSS's, the most involved


def _problem(seed: int, biases: bool = False, one_shard: bool = False):
    """Tokens [B, S, D], the router's choice [B*S, k], expert params (and biases)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    logits = rng.normal(size=(B * S, E))
    if one_shard:  # every token picks experts 0 and 1, both on the first shard: that shard's worst case
        logits[:, :2] += 100
    weights, experts, _ = routing.route(jnp.asarray(logits, jnp.float32), K, renormalize=True)
    shapes = ((E, D, F), (E, D, F), (E, F, D)) + (((E, F), (E, F), (E, D)) if biases else ())
    arrays = tuple(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in shapes)
    return x, experts, weights, arrays[:3], arrays[3:] or None


def _dropless(x, experts, weights, params, bias):
    return routing.dropless(x.reshape(-1, D), experts, weights, params, None, "cpu", glu, bias).reshape(x.shape)


@pytest.mark.parametrize("axes, biases", [
    ({"fsdp": 2, "expert": 4}, False), ({"data": 2, "expert": 2, "tensor": 2}, True),
], ids=["fsdp2-expert4", "data2-expert2-tensor2-biases"])
def test_equals_dropless_in_value_and_gradients(axes, biases: bool) -> None:
    x, experts, weights, params, bias = _problem(0, biases)
    mesh = make_mesh(axes)

    def value_and_grads(moe):  # the output and the gradients of a loss on it, from one compilation
        loss = lambda x, p, b: (lambda out: (jnp.sum(jnp.sin(out)), out))(moe(x, p, b))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, params, bias)

    grads, out = value_and_grads(lambda x, p, b: expert_parallel.dropless_ep(x, experts, weights, p, mesh, glu, b)[0])
    want_grads, want = value_and_grads(lambda x, p, b: _dropless(x, experts, weights, p, b))
    # Each row meets the same weights in the same order; only the tensor axis splits the down projection's sum
    # (measured: 0.0 without tensor, 2.4e-7 of the largest output with it).
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6 * float(jnp.abs(want).max()))
    # Weight gradients sum the rows' terms per device and then over the devices (measured within 3e-7 of each
    # leaf's largest entry); a lost or doubled shard is off by O(1).
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * float(jnp.abs(w).max()))


def test_the_worst_case_buffer_drops_nothing_when_every_pair_goes_to_one_shard() -> None:
    x, experts, weights, params, _ = _problem(0, one_shard=True)
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    out, kept = jax.jit(lambda x: expert_parallel.dropless_ep(x, experts, weights, params, mesh, glu))(x)
    assert bool(jnp.all(experts < 2)) and bool(jnp.all(kept))
    want = _dropless(x, experts, weights, params, None)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6 * float(jnp.abs(want).max()))


def _kept_by_spec(experts: np.ndarray, devices: int, shards: int, buffer: int) -> np.ndarray:
    """Each receiving shard takes its senders in mesh order, each sender's pairs by expert then token, until full."""
    local = E // shards
    pairs = experts.reshape(devices, -1)  # the batch axes put device (fsdp i, expert j) at row i * shards + j
    kept = np.zeros(pairs.shape, bool)
    for group in range(devices // shards):
        for receiver in range(shards):
            taken = 0
            for sender in range(group * shards, (group + 1) * shards):
                for i in np.argsort(pairs[sender], kind="stable"):
                    if pairs[sender, i] // local == receiver:
                        kept[sender, i] = taken < buffer
                        taken += 1
    return kept.reshape(experts.shape)


def test_a_bounded_buffer_drops_and_counts_exactly_the_pairs_past_it() -> None:
    x, experts, weights, params, _ = _problem(1)
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    factor = 0.75
    out, kept = jax.jit(lambda x: expert_parallel.dropless_ep(x, experts, weights, params, mesh, glu,
                                                              buffer_factor=factor))(x)
    buffer = expert_parallel.buffer_rows(S, K, E, 4, factor)
    assert buffer == 24  # three quarters of the 32 pairs a shard receives when balanced
    want_kept = _kept_by_spec(np.asarray(experts), 8, 4, buffer)
    assert (~want_kept).sum() == 64  # a quarter of the pairs, the later senders' on the busiest shards
    np.testing.assert_array_equal(kept, want_kept)
    # A dropped pair adds nothing: the token keeps its residual for that expert.
    want = _dropless(x, experts, weights * jnp.asarray(want_kept), params, None)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6 * float(jnp.abs(want).max()))
    stats = routing.router_stats(experts, jnp.ones((B * S, E)) / E, jnp.ones((B, S)), kept)
    assert float(stats["dropped"]) == (~want_kept).sum()


MOE = ["model=tiny_mixtral", "model.num_experts=8", "model.load_balance_weight=0.01", "train.batch_size=8",
       "train.warmup_steps=0"]  # the first step at the full learning rate (warmup would start it at 0)


def _train_step(axes: dict[str, int], devices, params, batch):
    """One train step from `params`: (new params, the gradient's Adam first moment, metrics)."""
    cfg = load_config("tiny", MOE)
    mesh = make_mesh(axes, devices)
    model = make_model(cfg.model, cfg.train, mesh, 32, log=lambda _: None)
    tx = make_optimizer(cfg.train)
    placed = jax.device_put(params, jax.tree.map(lambda a: a.sharding, abstract_params(model, 32, mesh)))
    with use_mesh(mesh):
        step = make_train_step(model, tx)
        batch = jax.device_put(batch, batch_sharding(mesh))
        new, opt_state, metrics = step(placed, init_opt_state(tx, placed, mesh), batch)
        return jax.device_get((new, optax.tree_utils.tree_get(opt_state, "mu"), metrics))


def test_train_step_on_an_expert_mesh_equals_one_device(monkeypatch) -> None:
    calls = []
    dropless_ep = expert_parallel.dropless_ep
    monkeypatch.setattr(expert_parallel, "dropless_ep", lambda *a, **kw: calls.append(1) or dropless_ep(*a, **kw))
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 512, (8, 33), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": (rng.random((8, 32)) > 0.1).astype(np.float32)}
    one = make_mesh({}, jax.devices()[:1])
    cfg = load_config("tiny", MOE)
    params = jax.device_get(init_params(make_model(cfg.model, cfg.train, one, 32, log=lambda _: None), 32, 0, one))
    want = _train_step({}, jax.devices()[:1], params, batch)
    assert not calls
    got = _train_step({"fsdp": 2, "expert": 4}, None, params, batch)
    assert calls  # the MoE layers ran by all-to-all
    # Float32 sums in another order, bounded as in tests/trainer/test_mesh_equivalence.py (measured: loss equal).
    for name in ("loss", "grad_norm", "load_balance_loss"):
        np.testing.assert_allclose(got[2][name], want[2][name], rtol=1e-5, err_msg=name)
    assert float(got[2]["dropped_fraction"]) == float(want[2]["dropped_fraction"]) == 0
    # Adam's first moment after one step is a tenth of the (clipped) gradient: bounded as gradients are there.
    # AdamW moves each weight by about lr x sign(gradient), so rounding of a gradient near 0 can move a weight by
    # a fraction of lr (measured 1.7e-3 lr); a wrong gradient moves weights by lr. The bound: 1e-2 lr.
    for path, w in jax.tree_util.tree_leaves_with_path(want[:2]):
        g = got
        for key in path:
            g = g[key.idx if hasattr(key, "idx") else key.key]
        bound = 1e-5 * np.abs(w).max() if path[0].idx == 1 else 1e-2 * cfg.train.learning_rate
        np.testing.assert_allclose(g, w, rtol=0, atol=bound, err_msg=jax.tree_util.keystr(path))


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")


@needs_libtpu
def test_compiles_for_tpu_to_ragged_all_to_all_without_gathering_the_tokens() -> None:
    from trainer.train.topology import slice_devices

    mesh = make_mesh({"fsdp": 2, "expert": 2}, slice_devices("v5p-8"))  # 4 chips
    x, experts, weights, params, _ = _problem(0)
    shard = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.NamedSharding(mesh, spec))  # noqa: E731
    P = jax.sharding.PartitionSpec
    tokens = P(("data", "fsdp", "expert"))
    args = (shard(x, tokens), shard(experts, tokens), shard(weights, tokens),
            tuple(shard(p, P("expert", "fsdp")) for p in params))

    def loss(x, experts, weights, params):
        return jnp.sum(expert_parallel.dropless_ep(x, experts, weights, params, mesh, glu)[0] ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 3))).lower(*args).compile().as_text()
    assert len(re.findall(r"ragged-all-to-all\(", hlo)) == 4  # tokens out and back, forward and backward
    # The only float gathers are of a shard's expert weights [E / 2, D, F] over fsdp, at the shard_map's boundary
    # (GSPMD's dropless gathers every token: [B * S, D] and more).
    gathered = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} all-gather(?:-start)?\(", hlo)
    assert set(gathered) == {f"{E // 2},{D},{F}", f"{E // 2},{F},{D}"}, gathered
