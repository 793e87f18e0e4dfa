"""Quantized training (trainer/model/quantization.py): the quantized forward pass stays close to the float one, int8 and fp8
training track float training, exactly the layers' projections and experts are quantized (fp8: e4m3 forward, e5m2
backward), weights and optimizer state stay float32 in the float params tree, and the refusals."""

from __future__ import annotations

import re
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from configs import UserError, load_config
from trainer.model import routing as moe
from trainer.model.decoder import Transformer
from trainer.train.optimizer import make_optimizer
from trainer.model.quantization import check_quantization, quantize
from trainer.model.sharding import batch_sharding, make_mesh, use_mesh
from trainer.train.loop import (
    abstract_batch, abstract_opt_state, abstract_params, init_opt_state, init_params, loss_and_grads, make_model,
    make_train_step,
)

SEQ, BATCH, STEPS, FP8_STEPS = 32, 8, 20, 5
QTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}


def _cfg(mode: str, *overrides: str):
    return load_config("tiny", [f"train.quantization={mode}", f"train.batch_size={BATCH}", "train.warmup_steps=3",
                                f"train.steps={STEPS}", *overrides])


def _batches(steps: int) -> list[dict[str, np.ndarray]]:
    """Sequences stepping by 7 through 64 tokens from random starts: a signal the tiny model learns in a few steps."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        seq = ((rng.integers(0, 64, (BATCH, 1)) + 7 * np.arange(SEQ + 1)) % 64).astype(np.int32)
        out.append({"inputs": seq[:, :-1], "targets": seq[:, 1:], "mask": np.ones((BATCH, SEQ), np.float32)})
    return out


def _train(mode: str, steps: int, axes: dict[str, int] | None = None) -> dict:
    """`steps` steps of the real train step (compiled once): losses, final params and optimizer state, the HLO."""
    cfg = _cfg(mode)
    mesh = make_mesh(axes or {}, jax.devices() if axes else jax.devices()[:1])
    model, tx = make_model(cfg.model, cfg.train, mesh, SEQ, log=lambda _: None), make_optimizer(cfg.train)
    params = init_params(model, SEQ, 0, mesh)
    opt_state = init_opt_state(tx, params, mesh)
    step = make_train_step(model, tx, 1, (abstract_params(model, SEQ, mesh), abstract_opt_state(tx, params, mesh)))
    losses = []
    with use_mesh(mesh):
        compiled = step.lower(params, opt_state, abstract_batch(BATCH, SEQ, mesh)).compile()
        for batch in _batches(steps):
            params, opt_state, out = compiled(params, opt_state, jax.device_put(batch, batch_sharding(mesh)))
            losses.append(float(out["loss"]))
    return {"losses": np.array(losses), "params": params, "opt_state": opt_state, "hlo": compiled.as_text()}


@pytest.fixture(scope="module")
def float_run() -> dict:
    return _train("none", STEPS)


@pytest.fixture(scope="module")
def int8_run() -> dict:
    return _train("int8", STEPS)


@pytest.fixture(scope="module")
def float_logits() -> tuple[Transformer, dict, jax.Array, jax.Array]:
    """The tiny model, random-init params, a batch of tokens and the float logits."""
    model = Transformer(_cfg("none").model)
    params = init_params(model, SEQ, 0, make_mesh({}, jax.devices()[:1]))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 512, (4, SEQ)), jnp.int32)
    return model, params, tokens, jax.jit(model.apply)({"params": params}, tokens)


@pytest.mark.parametrize("mode, bound", [("int8", 0.03), ("fp8", 0.1)])
def test_quantized_logits_stay_close_to_float(float_logits: tuple, mode: str, bound: float) -> None:
    model, params, tokens, want = float_logits
    got = jax.jit(quantize(model, mode).apply)({"params": params}, tokens)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    # Per-channel absmax int8 rounds each operand element by up to half a step of max/127: for roughly Gaussian
    # rows (max ~3.5 sigma) an RMS error of ~0.8% of the row's RMS, ~1.1% on a product of two; a dot of independent
    # errors keeps that relative size, and the residual stream does not compound it over 2 layers. fp8 e4m3 keeps
    # 3 mantissa bits: up to 2^-4 relative per element, RMS at most 3.6%, 5% on a product. Measured on this random
    # init: int8 0.9%, fp8 3.3%; the bounds leave ~3x room, while a wrong scale or a dropped matmul is off by O(1).
    # The floor shows the quantized path ran at all.
    assert 1e-4 < error < bound, f"{mode}: relative error {error:.4f}"


def test_int8_training_tracks_float(float_run: dict, int8_run: dict) -> None:
    want, got = float_run["losses"], int8_run["losses"]
    # The loss averages 256 tokens' cross-entropies, each perturbed by int8's ~1% zero-mean logit noise, and the
    # two runs' weights drift apart only through the int8 gradients' ~1% noise, which AdamW's per-parameter
    # normalisation keeps from compounding over 20 steps. Measured: at most 0.002 apart (0.0014 over 30 steps of
    # another signal) while the loss falls by 2.6; 0.01 leaves 5x room and is 0.4% of the fall.
    np.testing.assert_allclose(got, want, rtol=0, atol=0.01)
    assert got[-1] < got[0] - 1.0, f"int8 loss did not fall: {got}"


def test_fp8_training_is_e4m3_forward_e5m2_backward_and_tracks_float(float_run: dict) -> None:
    fp8 = _train("fp8", FP8_STEPS)
    # XLA:CPU emulates the fp8 matmuls, but the roundings to both formats stay in the compiled step.
    assert "f8e4m3fn" in fp8["hlo"] and "f8e5m2" in fp8["hlo"]
    # e4m3's 3 mantissa bits make ~4x int8's logit noise (see the logits test), and e5m2 gradients keep only 2.
    # Measured: 0.004 apart in these 5 steps, at most 0.0045 over 30; 0.03 leaves ~7x room.
    np.testing.assert_allclose(fp8["losses"], float_run["losses"][:FP8_STEPS], rtol=0, atol=0.03)


def _dots(model_file: str, mode: str, *overrides: str) -> set[tuple[str, str, str]]:
    """Every matmul of one train step's loss and gradients: (name scope, primitive, operand dtypes)."""
    cfg = load_config("tiny", [f"model={model_file}", f"train.quantization={mode}", *overrides])
    mesh = make_mesh({}, jax.devices()[:1])
    model = make_model(cfg.model, cfg.train, mesh, SEQ, log=lambda _: None)
    with use_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda p, b: loss_and_grads(model, p, b))(
            abstract_params(model, SEQ, mesh), abstract_batch(2, SEQ, mesh))
    dots: set[tuple[str, str, str]] = set()

    def walk(j) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                types = ",".join(str(v.aval.dtype) for v in eqn.invars[:2])
                dots.add((str(eqn.source_info.name_stack), eqn.primitive.name, types))
            for sub in jax_core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return dots


@pytest.mark.parametrize("model_file, mode, overrides, platform", [
    ("tiny", "int8", (), ""),
    ("tiny_mixtral", "int8", (), ""),  # dropless, CPU: tiles of one expert as one batched einsum
    ("tiny_mixtral", "fp8", (), "gpu"),  # dropless as on GPU and TPU: jax.lax.ragged_dot
    ("tiny_qwen3_moe", "int8", ("model.capacity_factor=1.5", "model.moe_every=2"), ""),  # capacity slots
    ("tiny_gpt_oss", "int8", (), ""),  # biases, sinks; experts with biases
    ("tiny_gemma4_moe", "int8", (), ""),  # two blocks a unit, keys as values, a dense MLP beside the experts
], ids=["dense", "moe-tiled", "moe-ragged", "moe-capacity", "gpt_oss", "gemma4_moe"])
def test_only_the_projections_and_experts_are_quantized(
    model_file: str, mode: str, overrides: tuple[str, ...], platform: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if platform:
        grouped = moe.grouped_matmul
        monkeypatch.setattr(moe, "grouped_matmul", lambda x, w, sizes, _: grouped(x, w, sizes, platform))
    dots = _dots(model_file, mode, *overrides)
    experts = set()
    for name, primitive, types in dots:
        # The experts' matmuls: the ragged dot, or the einsum of expert tiles (dropless on CPU) or of capacity slots.
        expert = primitive == "ragged_dot_general" or re.search(r"moe/(ntd,ndf|becd,edf)", name)
        experts |= {name} if expert else set()
        if expert or re.search(r"attn/[qkvo]_proj|mlp/(gate|up|down)_proj", name):
            assert QTYPES[mode] in types, (name, primitive, types)
        else:  # router, output head, attention's scores and values, the MoE combine and router statistics
            assert types == "float32,float32", (name, primitive, types)
    assert bool(experts) == (model_file != "tiny")
    if mode == "fp8":  # forward e4m3 x e4m3; the incoming gradient of the backward matmuls in e5m2
        types = {t for _, _, t in dots}
        assert "float8_e4m3fn,float8_e4m3fn" in types and any("float8_e5m2" in t for t in types)


def test_weights_and_optimizer_state_stay_float32_in_the_float_params_tree(int8_run: dict) -> None:
    cfg, mesh = _cfg("int8"), make_mesh({}, jax.devices()[:1])
    plain = Transformer(cfg.model)
    quantized = make_model(cfg.model, cfg.train, mesh, SEQ, log=lambda _: None)
    # The same tree, shapes and dtypes: checkpoints and exports of a quantized run are ordinary float weights.
    shapes = lambda model: jax.tree.map(lambda x: (x.shape, x.dtype), abstract_params(model, SEQ, mesh))  # noqa: E731
    assert shapes(quantized) == shapes(plain)
    variables = jax.eval_shape(quantized.init, jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
    assert set(variables) == {"params"}  # no quantization state beside the params
    for leaf in jax.tree.leaves(int8_run["params"]):
        assert leaf.dtype == jnp.float32
    for leaf in jax.tree.leaves(int8_run["opt_state"]):  # Adam moments float32; the step count an integer
        assert leaf.dtype in (jnp.float32, jnp.int32)
    assert sum(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(int8_run["opt_state"])) >= 2 * len(
        jax.tree.leaves(int8_run["params"]))


def test_sharded_int8_step_matches_one_device(int8_run: dict) -> None:
    sharded = _train("int8", 2, {"fsdp": 2, "tensor": 2, "data": 2})
    # Per-channel scales over a sharded contraction (o_proj, down_proj under tensor) come from an all-reduced max,
    # so the int8 values equal one device's; only float sums change order, and an operand nudged across a
    # rounding boundary moves one element by one step. Measured 3e-5 to 7e-5 apart; a missing all-reduce is O(1).
    np.testing.assert_allclose(sharded["losses"], int8_run["losses"][:2], rtol=0, atol=5e-4)


def _device(platform: str, kind: str, capability: str = "") -> SimpleNamespace:
    """A stand-in for a jax.Device: what check_quantization reads."""
    return SimpleNamespace(platform=platform, device_kind=kind, compute_capability=capability)


def test_refusals_and_warnings() -> None:
    a100, h100 = _device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), _device("gpu", "NVIDIA H100 80GB HBM3", "9.0")
    for device in (a100, _device("gpu", "AMD Instinct MI300X", "gfx942")):
        with pytest.raises(UserError) as refused:
            check_quantization("fp8", device)
        assert "\n" not in str(refused.value) and "int8" in str(refused.value)
    assert check_quantization("fp8", h100) == ""
    assert check_quantization("fp8", _device("gpu", "NVIDIA L4", "8.9")) == ""
    assert check_quantization("fp8", _device("tpu", "TPU7x")) == ""
    for device in (jax.devices()[0], _device("tpu", "TPU v5 lite"), _device("tpu", "TPU v6 lite")):
        warning = check_quantization("fp8", device)
        assert warning and "\n" not in warning
    for device in (jax.devices()[0], a100, h100, _device("tpu", "TPU v4")):
        assert check_quantization("int8", device) == "" and check_quantization("none", device) == ""
