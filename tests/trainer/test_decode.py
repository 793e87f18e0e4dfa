"""KV-cache decoding against re-running the whole model, batching, sampling filters; scan/remat/packing per feature."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import load_config
from trainer.eval.decode import generate_batch, sample_logits
from trainer.model.decoder import Transformer, init_cache

# A model with every feature on: local/global layers, QK-norm, post norms, soft-capping, (1 + w) norms.
GEMMA3_LIKE = dict(
    family="gemma3", activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True, qk_norm=True, post_norms=True,
    query_pre_attn_scalar=24.0, attn_softcap=5.0, final_softcap=10.0, sliding_window=12, global_every=2,
    num_layers=4, rope_local_theta=10000.0, rope_theta=1e6, rope_scaling="linear", rope_factor=4.0,
)


@pytest.fixture(scope="module", params=["llama", "gemma3_like"])
def model(request):
    cfg = load_config("tiny").model
    if request.param == "gemma3_like":
        cfg = cfg.model_copy(update=GEMMA3_LIKE)
    params = nn.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    params = jax.tree.map(lambda p: p * 8 if p.ndim > 2 else p, params)  # sharper attention than the init's
    return cfg, params


def _naive_greedy(cfg, params, prompt: list[int], steps: int) -> list[int]:
    """Argmax decoding by re-running the model on the whole sequence (right-padded: causal, so pads don't matter)."""
    apply = jax.jit(Transformer(cfg).apply)
    buf = np.zeros((1, 64), np.int32)
    buf[0, : len(prompt)] = prompt
    for n in range(len(prompt), len(prompt) + steps):
        buf[0, n] = int(np.argmax(apply({"params": params}, jnp.asarray(buf))[0, n - 1]))
    return buf[0, len(prompt) : len(prompt) + steps].tolist()


def test_cached_greedy_matches_rerunning_the_model(model):
    cfg, params = model
    prompts = [list(np.random.default_rng(i).integers(1, 512, n)) for i, n in enumerate((40, 7, 23))]
    batched = generate_batch(params, cfg, prompts, 10)
    for prompt, got in zip(prompts, batched):
        assert got == _naive_greedy(cfg, params, prompt, 10)
    assert generate_batch(params, cfg, [prompts[1]], 10) == [batched[1]]  # the batch's left padding changes nothing


def test_prefill_and_steps_match_full_forward(model):
    cfg, params = model
    tokens = jnp.asarray(np.random.default_rng(5).integers(1, 512, (2, 30)))
    apply = jax.jit(Transformer(cfg).apply)
    full = apply({"params": params}, tokens)
    cache = init_cache(cfg, 2, 32)
    first, cache = apply({"params": params}, tokens[:, :20], cache=cache)
    rest = []
    for i in range(20, 30):
        logits, cache = apply({"params": params}, tokens[:, i:i + 1], jnp.full((2, 1), i), cache=cache)
        rest.append(logits)
    stepped = jnp.concatenate([first, *rest], axis=1)
    np.testing.assert_allclose(stepped, full, atol=1e-4 * float(jnp.abs(full).max()))
    assert int(cache["index"]) == 30


def test_eos_stops_each_row(model):
    cfg, params = model
    prompts = [[5, 17, 300, 2], [9, 9, 1]]
    free = generate_batch(params, cfg, prompts, 6)
    eos = free[0][2]
    stopped = generate_batch(params, cfg, prompts, 6, eos_id=eos)
    for row, got in zip(free, stopped):
        assert got == (row[: row.index(eos)] if eos in row else row)


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    draw = lambda temp, k, p: np.asarray(sample_logits(logits, jax.random.key(0), jnp.float32(temp), jnp.int32(k), jnp.float32(p)))  # noqa: E731
    assert set(draw(0.0, 0, 1.0)) == {0}
    assert set(draw(1.0, 0, 1.0)) == {0, 1, 2, 3}
    assert set(draw(1.0, 2, 1.0)) == {0, 1}
    assert set(draw(1.0, 0, 0.7)) == {0, 1}  # 0.5 < 0.7 so token 1 is still needed
    assert set(draw(1.0, 0, 0.5)) == {0}
    freq = np.bincount(draw(1.0, 0, 0.9), minlength=4) / 2000  # 0.5 + 0.3 < 0.9: three tokens, renormalised
    np.testing.assert_allclose(freq, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.04)
    assert np.asarray(sample_logits(logits[:1], jax.random.key(0), jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))).shape == (1,)


def test_remat_and_packed_documents(model):
    cfg, params = model
    rng = np.random.default_rng(3)
    a, b = rng.integers(1, 512, 20), rng.integers(1, 512, 12)
    packed = jnp.asarray([np.concatenate([a, b])])
    segments = jnp.asarray([[1] * 20 + [2] * 12])
    positions = jnp.asarray([list(range(20)) + list(range(12))])
    apply = jax.jit(Transformer(cfg).apply)
    logits = apply({"params": params}, packed, positions, segments)
    alone = apply({"params": params}, jnp.asarray([b]))
    np.testing.assert_allclose(logits[0, 20:], alone[0], atol=1e-4 * float(jnp.abs(alone).max()))

    def loss(p, remat):
        return Transformer(cfg, remat=remat).apply({"params": p}, packed, positions, segments).mean()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    plain, full = grad(params, "none"), grad(params, "full")
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), plain, full)


def test_every_parameter_has_logical_axes(model):
    cfg, _ = model
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    specs = jax.tree.leaves(nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    shapes = jax.tree.leaves(nn.unbox(boxed))
    assert len(specs) == len(shapes) and all(len(s) == len(x.shape) for s, x in zip(specs, shapes))
    if cfg.qk_norm:
        assert nn.get_partition_spec(boxed)["layers"]["attn"]["q_norm"]["scale"] == jax.sharding.PartitionSpec("layers", "head_dim")


def test_sharded_forward_matches_unsharded(model):
    from trainer.model.sharding import logical_shardings, make_mesh, use_mesh

    cfg, params = model
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    sharded = jax.device_put(params, logical_shardings(boxed, mesh))
    assert tuple(sharded["layers"]["attn"]["q_proj"]["kernel"].sharding.spec) == (None, ("fsdp", "expert"), "tensor", None)
    tokens = jnp.asarray(np.random.default_rng(6).integers(1, 512, (4, 40)))
    with use_mesh(mesh):
        got = jax.jit(Transformer(cfg).apply)({"params": sharded}, tokens)
    want = jax.jit(Transformer(cfg).apply)({"params": params}, tokens)
    np.testing.assert_allclose(got, want, atol=1e-4 * float(jnp.abs(want).max()))
