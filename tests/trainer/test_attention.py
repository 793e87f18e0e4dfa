"""Attention kernels: splash (run in Pallas's interpreter on CPU) against XLA's attention, and the choice of kernel."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import pytest

from configs import UserError, load_config
from tests.trainer.test_train_step import _batch
from trainer.model.kernels import choose, flash_attention, xla_attention
from trainer.model.decoder import Transformer, init_cache
from trainer.model.sharding import batch_sharding, make_mesh, use_mesh
from trainer.train.loop import abstract_params, init_params, loss_and_grads

# Flash kernels sum the softmax block by block (online softmax) where XLA sums each row at once: float32
# rounding (2^-24 relative per addition) differs by a few ulps of the largest value. Measured on these
# shapes: outputs within 5e-7 and gradients within 1.4e-6 of the largest entry; the bound leaves ~10x headroom,
# while a wrong mask is off by far more (a window one token too wide: 0.18).
TOL = 2e-5


def _close(got, want, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * np.abs(want).max(), err_msg=what)


def _dense_mask(segments: np.ndarray | None, seq: int, window: int) -> np.ndarray:
    i = np.arange(seq)
    mask = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
    mask = np.broadcast_to(mask, (2, seq, seq))
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    return mask[:, None]


@pytest.mark.parametrize("head_dim, kv_heads, window, documents, softcap", [
    (64, 4, 0, False, 0.0), (64, 2, 0, False, 0.0), (64, 4, 100, True, 0.0), (64, 2, 0, True, 30.0),
    (64, 1, 130, True, 5.0), (128, 4, 0, False, 0.0), (128, 2, 100, True, 30.0),
], ids=["causal-64", "gqa-64", "window+documents-64", "gqa+documents+softcap-64", "mqa+window+documents+softcap-64",
        "causal-128", "gqa+window+documents+softcap-128"])
def test_splash_matches_xla(head_dim: int, kv_heads: int, window: int, documents: bool, softcap: float) -> None:
    # 384 tokens: three 128-token tiles, so the kernel's skipping of masked tiles is exercised too.
    seq, heads, scale = 384, 4, head_dim**-0.5
    keys = jax.random.split(jax.random.key(head_dim + kv_heads + window), 4)
    q = jax.random.normal(keys[0], (2, seq, heads, head_dim))
    k, v = (jax.random.normal(key, (2, seq, kv_heads, head_dim)) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape)
    # Documents of uneven lengths, boundaries inside and across tiles.
    segments = np.stack([np.searchsorted([50, 200, 260], np.arange(seq), side="right"),
                         np.searchsorted([128, 129, 300], np.arange(seq), side="right")]).astype(np.int32)
    segments = segments if documents else None
    mask = _dense_mask(segments, seq, window)

    def splash(q, k, v):
        return flash_attention("splash", q, k, v, segments, scale=scale, softcap=softcap, window=window)

    def xla(q, k, v):
        return xla_attention(q, k, v, jnp.asarray(mask), False, scale, softcap)

    want, want_vjp = jax.vjp(xla, q, k, v)
    got, got_vjp = jax.vjp(splash, q, k, v)
    _close(got, want, "output")
    for name, g, w in zip("qkv", got_vjp(cotangent), want_vjp(cotangent)):
        _close(g, w, f"d{name}")


def test_splash_with_sinks_matches_xla() -> None:
    """GPT-OSS's attention sinks through splash (a logit per head joining each softmax row): outputs and gradients,
    the sinks' own included, equal XLA's; GQA, a window and documents on."""
    seq, heads, kv_heads, head_dim, window = 256, 4, 2, 64, 100
    keys = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(keys[0], (2, seq, heads, head_dim))
    k, v = (jax.random.normal(key, (2, seq, kv_heads, head_dim)) for key in keys[1:3])
    sinks = 2.0 * jax.random.normal(keys[3], (heads,))
    cotangent = jax.random.normal(keys[4], q.shape)
    segments = np.stack([np.searchsorted([50, 200], np.arange(seq), side="right")] * 2).astype(np.int32)
    mask = _dense_mask(segments, seq, window)

    def splash(q, k, v, s):
        return flash_attention("splash", q, k, v, segments, scale=head_dim**-0.5, softcap=0.0, window=window, sinks=s)

    def xla(q, k, v, s):
        return xla_attention(q, k, v, jnp.asarray(mask), False, head_dim**-0.5, 0.0, s)

    want, want_vjp = jax.vjp(xla, q, k, v, sinks)
    got, got_vjp = jax.vjp(splash, q, k, v, sinks)
    _close(got, want, "output")
    for name, g, w in zip(["q", "k", "v", "sinks"], got_vjp(cotangent), want_vjp(cotangent)):
        _close(g, w, f"d{name}")


SEQ = 128  # the shortest sequence splash tiles


def _documents_batch(rows: int) -> dict[str, np.ndarray]:
    batch = _batch(rows, seed=3)
    batch = {k: np.resize(v, (rows, SEQ)) for k, v in batch.items()}
    batch["segment_ids"] = np.repeat(np.arange(1, 5), SEQ // 4)[None].repeat(rows, 0).astype(np.int32)
    batch["positions"] = np.tile(np.arange(SEQ // 4), 4)[None].repeat(rows, 0).astype(np.int32)
    return batch


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", []),
    # Local and global layers (each picks its kernel per layer), soft-capping, QK-norm, post norms.
    ("tiny", ["model=tiny_gemma3", "model.attn_softcap=20.0"]),
], ids=["llama", "gemma3+softcap"])
def test_model_with_splash_on_a_mesh_matches_xla(preset: str, overrides: list[str]) -> None:
    """Loss and gradients of the whole model, splash under shard_map on (fsdp 2, tensor 2), equal XLA's on one device."""
    cfg = load_config(preset, overrides).model
    one = make_mesh({}, jax.devices()[:1])
    xla_model = Transformer(cfg)
    params = jax.device_get(init_params(xla_model, SEQ, 0, one))
    batch = _documents_batch(4)

    def run(model: Transformer, mesh) -> tuple:
        placed = jax.device_put(params, jax.tree.map(lambda x: x.sharding, abstract_params(model, SEQ, mesh)))
        with use_mesh(mesh):
            step = jax.jit(lambda p, b: loss_and_grads(model, p, b))
            out, grads = jax.device_get(step(placed, jax.device_put(batch, batch_sharding(mesh))))
            return out["loss"], grads

    loss, grads = run(xla_model, one)
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
    loss_s, grads_s = run(Transformer(cfg, attention="splash", mesh=mesh), mesh)
    np.testing.assert_allclose(loss_s, loss, rtol=1e-6)
    for (path, g), g_s in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_s)):
        _close(g_s, g, jax.tree_util.keystr(path))


def test_decoding_with_a_cache_runs_xla_whatever_the_kernel() -> None:
    cfg = load_config("tiny", ["model=tiny_gemma3"]).model
    params = jax.device_get(init_params(Transformer(cfg), 16, 0, make_mesh({}, jax.devices()[:1])))
    tokens = jnp.asarray(_batch(2, seed=0)["inputs"][:, :16])

    @jax.jit
    def prefill_and_step(params):
        outs = []
        for kernel in ("xla", "splash"):
            model = Transformer(cfg, attention=kernel)
            logits, cache = model.apply({"params": params}, tokens, cache=init_cache(cfg, 2, 24))
            outs.append((logits, model.apply({"params": params}, tokens[:, :1], cache=cache)[0]))
        return outs

    (logits, step), *others = prefill_and_step(params)
    for other_logits, other_step in others:
        np.testing.assert_array_equal(other_logits, logits)
        np.testing.assert_array_equal(other_step, step)


CPU = SimpleNamespace(platform="cpu", device_kind="cpu")
H100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
A100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
TPU = SimpleNamespace(platform="tpu", device_kind="TPU v5")


def _model(*overrides: str):
    return load_config("tiny", list(overrides)).model


def test_auto_picks_the_platforms_kernel() -> None:
    bf16 = _model("model.dtype=bfloat16")
    assert choose("auto", bf16, CPU, 128) == ("xla", "")
    assert choose("auto", bf16, H100, 128) == ("cudnn", "")
    assert choose("auto", bf16, TPU, 128) == ("splash", "")
    assert choose("xla", bf16, TPU, 128) == ("xla", "")


@pytest.mark.parametrize("requested, device, overrides, seq, tensor, reason", [
    ("auto", H100, [], 128, 1, "model.dtype is float32"),
    ("cudnn", H100, ["model.dtype=bfloat16", "model.attn_softcap=50.0"], 128, 1, "cannot soft-cap"),
    ("cudnn", A100, ["model.dtype=bfloat16", "model.head_dim=256"], 128, 1, "head_dim <= 128"),
    ("auto", TPU, [], 64, 1, "tiles sequences by 128 tokens and they are 64"),
    ("splash", TPU, [], 128, 4, "2 kv heads do not split over train.mesh tensor=4"),
])
def test_a_kernel_that_cannot_falls_back_to_xla_saying_why(requested, device, overrides, seq, tensor, reason) -> None:
    kernel, why = choose(requested, _model(*overrides), device, seq, tensor)
    assert kernel == "xla" and reason in why


@pytest.mark.parametrize("requested, device", [("cudnn", CPU), ("cudnn", TPU), ("splash", CPU), ("splash", H100)])
def test_a_kernel_the_devices_cannot_run_is_an_error(requested, device) -> None:
    with pytest.raises(UserError, match=f"model.attention={requested} needs"):
        choose(requested, _model(), device, 128)


@pytest.mark.parametrize("documents, window", [(False, 0), (True, 100)])
def test_cudnn_call_passes_jaxs_own_checks(monkeypatch, documents: bool, window: int) -> None:
    """No GPU here: trace the cuDNN path (forward and backward) through jax's argument checks and read what reaches
    the kernel. cuDNN's window (pos - length, pos] must be our `window` latest tokens, the query's own included."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)  # what jax asks the (absent) cuDNN library
    q, k = jnp.zeros((2, 256, 4, 64), jnp.bfloat16), jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
    segments = jnp.zeros((2, 256), jnp.int32) if documents else None

    def loss(q, k, v):
        out = flash_attention("cudnn", q, k, v, segments, scale=0.125, softcap=0.0, window=window)
        return out.astype(jnp.float32).sum()

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k))
    assert "mask_type=MaskType.CAUSAL" in jaxpr
    assert f"sliding_window_length={window or None}" in jaxpr


@pytest.mark.parametrize("requested, device, overrides, seq, reason", [
    ("auto", H100, ["model.dtype=bfloat16"], 256, "refuses a sequence split over train.mesh context=2"),
    ("splash", TPU, [], 128, "tiles each context shard's 128 / 2 tokens by 128"),
])
def test_context_parallelism_falls_back_where_a_kernel_cannot_split_the_sequence(
    requested, device, overrides, seq, reason
) -> None:
    kernel, why = choose(requested, _model(*overrides), device, seq, context=2)
    assert kernel == "xla" and reason in why
    assert choose("auto", _model(), TPU, 256, context=2) == ("splash", "")
