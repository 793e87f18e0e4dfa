"""MXFP4 (trainer/hf/mxfp4.py): dequantize is bit for bit transformers' convert_moe_packed_tensors (all 65,536 scale and
byte pairs, in each dtype it takes), on any leading dims and chunking; quantize inverts it on the FP4 grid and stays
within e2m1's rounding error off it."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from ml_dtypes import bfloat16
from transformers.integrations.mxfp4 import FP4_VALUES as HF_FP4_VALUES
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from trainer.hf.mxfp4 import FP4_VALUES, dequantize, quantize

DTYPES = [(torch.bfloat16, bfloat16), (torch.float32, np.float32), (torch.float16, np.float16),
          (torch.float64, np.float64)]
EDGE_SCALES = [0, 1, 2, 126, 127, 128, 253, 254, 255]


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])  # bits, -0 and NaN included


def _hf(blocks: np.ndarray, scales: np.ndarray, dtype: torch.dtype | None) -> np.ndarray:
    """transformers' [E, in, out] (its default dtype when None), transposed back to the hub's [E, out, in], as bits."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    t = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), **kwargs)
    t = t.transpose(1, 2).contiguous()
    return _bits(t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy())


def _all_pairs() -> tuple[np.ndarray, np.ndarray]:
    """[2 experts, 256 rows, 16 groups, 16]: row s has scale byte s and all 256 block bytes (reversed in expert 1)."""
    blocks = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16), (2, 256, 16, 16)).copy()
    blocks[1] = blocks[1, :, ::-1]
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (2, 256, 16)).copy()
    return blocks, scales


def _random(shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random blocks [*shape, 16] and scales [*shape] in 100..140, with the edge scales at random places."""
    rng = np.random.default_rng(seed)
    scales = rng.integers(100, 141, shape, dtype=np.uint8)
    edges = EDGE_SCALES[:scales.size]
    scales.reshape(-1)[rng.choice(scales.size, len(edges), replace=False)] = edges
    return rng.integers(0, 256, (*shape, 16), dtype=np.uint8), scales


def test_lut_is_transformers():
    assert np.array_equal(FP4_VALUES, HF_FP4_VALUES)
    assert np.array_equal(np.signbit(FP4_VALUES), np.signbit(HF_FP4_VALUES))


def test_transformers_default_dtype_is_bfloat16():
    assert inspect.signature(convert_moe_packed_tensors).parameters["dtype"].default == torch.bfloat16
    blocks, scales = _random((2, 3, 2))
    assert np.array_equal(_hf(blocks, scales, None), _bits(dequantize(blocks, scales, bfloat16)))


@pytest.mark.parametrize("torch_dtype, dtype", DTYPES, ids=["bfloat16", "float32", "float16", "float64"])
def test_dequantize_all_scale_byte_pairs_bit_exact(torch_dtype, dtype):
    blocks, scales = _all_pairs()
    ours = dequantize(blocks, scales, dtype)
    assert ours.dtype == np.dtype(dtype) and ours.shape == (2, 256, 512)
    assert np.array_equal(_hf(blocks, scales, torch_dtype), _bits(ours))


@pytest.mark.parametrize("torch_dtype, dtype", DTYPES[:2], ids=["bfloat16", "float32"])
def test_dequantize_random_bit_exact(torch_dtype, dtype):
    blocks, scales = _random((4, 48, 6))
    assert np.array_equal(_hf(blocks, scales, torch_dtype), _bits(dequantize(blocks, scales, dtype)))


def test_dequantize_edge_values():
    """Scale 255 (NaN in OCP's E8M0) is 2**128 as in transformers: +-inf in 32-bit floats but for 0 and +-0.5."""
    blocks = np.array([[[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] + [0] * 8]] * 4, np.uint8)  # codes 0..15
    scales = np.array([[0], [127], [254], [255]], np.uint8)
    out = dequantize(blocks, scales)[:, :16]
    assert np.array_equal(out[1], FP4_VALUES) and np.array_equal(np.signbit(out[1]), np.signbit(FP4_VALUES))
    assert np.array_equal(out[0], np.ldexp(FP4_VALUES, -127).astype(np.float32))  # subnormal, exact
    assert out[0, 1] == np.float32(2.0**-128) and out[2, 3] == np.float32(1.5 * 2.0**127) and out[2, 4] == np.inf
    assert np.array_equal(out[3], [0, 2.0**127] + [np.inf] * 6 + [0, -(2.0**127)] + [-np.inf] * 6)


def test_dequantize_leading_dims():
    blocks, scales = _random((3, 5, 4))
    full = dequantize(blocks, scales)
    assert full.shape == (3, 5, 128)
    assert np.array_equal(dequantize(blocks[1], scales[1]), full[1])  # one expert [out, G, 16]
    assert np.array_equal(dequantize(blocks[1, 2], scales[1, 2]), full[1, 2])  # one row [G, 16]
    assert np.array_equal(dequantize(blocks[None], scales[None]), full[None])
    assert np.array_equal(dequantize(blocks.reshape(15, 4, 16), scales.reshape(15, 4)), full.reshape(15, 128))


@pytest.mark.parametrize("dtype", [bfloat16, np.float32])
def test_dequantize_chunking(dtype):
    blocks, scales = _random((2, 7, 9))  # 126 blocks
    whole = _bits(dequantize(blocks, scales, dtype, chunk_blocks=10_000))
    for chunk in (1, 5, 64, 125, 126):
        assert np.array_equal(_bits(dequantize(blocks, scales, dtype, chunk_blocks=chunk)), whole)


def test_dequantize_refusals():
    blocks, scales = _random((2, 3))
    with pytest.raises(TypeError):
        dequantize(blocks.astype(np.int8), scales)
    with pytest.raises(ValueError):
        dequantize(blocks[..., :8], scales)
    with pytest.raises(ValueError):
        dequantize(blocks, scales[:, :2])
    with pytest.raises(ValueError):
        dequantize(blocks, scales, np.int32)


def test_round_trip_exact_on_grid():
    """Values on the grid (any code, a power of two a block in 2**-120..2**120) come back exactly, in every dtype."""
    rng = np.random.default_rng(1)
    exps = rng.integers(-120, 121, (3, 8, 4))
    exps[0, 0, 0] = -127  # the least scale
    w = FP4_VALUES[rng.integers(0, 16, (3, 8, 128))] * np.repeat(np.ldexp(1.0, exps), 32, axis=-1)
    w[1, 1, :32] = 0.0  # an all-zero block
    blocks, scales = quantize(w)
    assert blocks.shape == (3, 8, 4, 16) and scales.shape == (3, 8, 4) and blocks.dtype == scales.dtype == np.uint8
    for dtype in (np.float64, np.float32, bfloat16):
        out = dequantize(blocks, scales, dtype)
        assert np.array_equal(out.astype(np.float64), w.astype(dtype).astype(np.float64))
    assert np.array_equal(np.signbit(dequantize(blocks, scales)), np.signbit(w))  # -0 stays -0


def test_round_trip_bytes():
    """Blocks whose largest code is +-4 or +-6 (so the scale is the least that fits) quantize back to the same bytes."""
    blocks, scales = _random((6, 5))
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(6, 5, 32)
    codes[..., 0] = np.where(np.arange(30).reshape(6, 5) % 2, 6, 15)  # 4.0 or -6.0
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scales = np.minimum(scales, 254)
    b, s = quantize(dequantize(blocks, scales, np.float64))
    assert np.array_equal(b, blocks) and np.array_equal(s, scales)


def test_quantize_rounds_to_nearest_ties_to_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w = np.array([*ties, *(-t for t in ties), 0.3, 0.7, 1.3, 5.1, 6.0] + [0.0] * 13)
    blocks, scales = quantize(w)
    assert scales.tolist() == [127]
    expect = [0, 1, 1, 2, 2, 4, 4]
    assert dequantize(blocks, scales).tolist() == [*expect, *(-t for t in expect), 0.5, 0.5, 1.5, 6, 6] + [0.0] * 13


def test_round_trip_close_on_normals():
    """e2m1 has one mantissa bit: at most 1/5 relative error (at 1.25 * 2**k) for |w| >= 2**e, else at most 2**e / 4."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((4, 64, 256)) * 0.02).astype(np.float32)
    w[0, 0, :32] *= 1e-30  # a block of tiny values
    blocks, scales = quantize(w)
    got = dequantize(blocks, scales).astype(np.float64)
    step = np.repeat(np.ldexp(1.0, scales.astype(np.int32) - 127), 32, axis=-1)
    err = np.abs(got - w)
    assert (err <= np.maximum(np.abs(w) / 5, step / 4)).all()
    assert np.sqrt((err**2).mean() / (w.astype(np.float64) ** 2).mean()) < 0.15  # ~0.12 for normals
    amax = np.abs(w).reshape(4, 64, 8, 32).max(-1)
    assert (amax <= 6 * step[..., ::32]).all() and (amax > 3 * step[..., ::32]).all()  # the least scale that fits


def test_quantize_refusals():
    with pytest.raises(ValueError):
        quantize(np.zeros((2, 48)))
    with pytest.raises(ValueError):
        quantize(np.full((1, 32), np.nan))
