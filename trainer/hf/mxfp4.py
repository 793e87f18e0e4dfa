"""MXFP4 (OCP microscaling FP4 e2m1, one shared E8M0 exponent per 32 values) <-> float, for GPT-OSS hub checkpoints.

Hub layout: `*_blocks` uint8 [..., out, G, 16] (two 4-bit codes a byte, low nibble first), `*_scales` uint8
[..., out, G].
"""

# Written here rather than calling transformers' `convert_moe_packed_tensors` (transformers/integrations/mxfp4.py):
# that needs torch, a test-only dependency of this project, and ingest must run without torch. dequantize is bit for
# bit what it gives on CPU (tests/trainer/test_mxfp4.py), except that ours keeps the hub's [out, in] order (it
# returns [E, in, out]).

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numpy.typing import DTypeLike

# The 16 e2m1 codes: bit 3 the sign, then 2 exponent bits and 1 mantissa bit (transformers' FP4_VALUES).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
SCALE_BIAS = 127  # scale byte s means 2 ** (s - 127)
_PAIR_VIEW = {2: np.uint32, 4: np.uint64, 8: np.complex128}  # two values of an itemsize, copied as one item
_MIDPOINTS = (FP4_VALUES[1:8] + FP4_VALUES[:7]) / 2  # between neighbouring magnitudes 0, .5, ..., 6


@lru_cache(maxsize=8)
def _table(dtype: np.dtype) -> np.ndarray:
    """(scale byte << 8 | block byte) -> the byte's two values (low nibble first) in dtype, as one pair-sized item."""
    byte = np.arange(256)
    pairs = np.stack([FP4_VALUES[byte & 15], FP4_VALUES[byte >> 4]], axis=-1)  # [256 bytes, 2]
    exp = np.arange(256, dtype=np.int32)[:, None, None] - SCALE_BIAS  # [256 scales, 1, 1]
    # Exact in float64 (|value| in [2**-128, 6 * 2**128]), then one round-to-nearest-even cast to dtype, which is what
    # torch's CPU ldexp gives; in float32 and bfloat16 every value is exact but those >= 2**128, which become inf.
    with np.errstate(over="ignore"):
        table = np.ascontiguousarray(np.ldexp(pairs[None], exp).astype(dtype))  # [256 scales, 256 bytes, 2]
    table = table.view(_PAIR_VIEW[dtype.itemsize]).reshape(256 * 256)
    table.flags.writeable = False
    return table


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: DTypeLike = np.float32,
               chunk_blocks: int = 1 << 14) -> np.ndarray:
    """uint8 blocks [..., G, 16] and scales [..., G] -> [..., G * 32] in dtype (hub order, not transposed).

    All 256 scale bytes: value = code * 2 ** (s - 127), rounded once to dtype (float16, bfloat16, float32 or float64),
    over/underflowing there as transformers does (255 is 2**128, not OCP's NaN: in bfloat16 and float32 codes +-1 and
    up give +-inf, 0 gives 0). Converts chunk_blocks blocks of 32 values at a time: beyond the output it holds 10 bytes
    a block byte of a chunk (2.5 MiB at the default) and a table of 65,536 value pairs (256 KiB for bfloat16).
    """
    dtype = np.dtype(dtype)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: want [..., G, 16] and [..., G]")
    if dtype.name not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(f"MXFP4 dequantizes to float16, bfloat16, float32 or float64, not {dtype}")
    table = _table(dtype)
    n = scales.size
    codes, exps = blocks.reshape(n, 16), scales.reshape(n, 1)
    out = np.empty((n, 32), dtype)
    pairs = out.view(table.dtype)  # [n, 16]: one item per byte
    for r0 in range(0, n, chunk_blocks):
        r1 = min(n, r0 + chunk_blocks)
        idx = np.left_shift(exps[r0:r1], 8, dtype=np.uint16) | codes[r0:r1]
        # mode="clip" (idx < 65,536 anyway): the default "raise" makes take buffer the whole of out.
        np.take(table, idx, out=pairs[r0:r1], mode="clip")
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float [..., out, in] (in % 32 == 0) -> hub (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]).

    Each 32 values share the least exponent e in [-127, 127] with max|w| <= 6 * 2**e; each value rounds to the nearest
    e2m1 code (ties to even code), so dequantize(*quantize(w)) == w for w on the grid, else
    |error| <= max(|w|/5, 2**e/4).
    """
    w = np.asarray(w, dtype=np.float64)
    if w.ndim < 1 or w.shape[-1] % 32:
        raise ValueError(f"MXFP4 quantizes [..., in] with in a multiple of 32, not {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("MXFP4 cannot hold inf or NaN")
    w = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(w).max(axis=-1)
    with np.errstate(divide="ignore"):
        exp = np.ceil(np.log2(amax / 6))
    exp = np.clip(np.nan_to_num(exp, neginf=-SCALE_BIAS), -SCALE_BIAS, SCALE_BIAS).astype(np.int32)
    # log2 is not exact: make e the least with amax <= 6 * 2**e (within the clip).
    exp += (amax > np.ldexp(6.0, exp)) & (exp < SCALE_BIAS)
    exp -= (amax <= np.ldexp(6.0, exp - 1)) & (exp > -SCALE_BIAS)
    mag = np.minimum(np.abs(np.ldexp(w, -exp[..., None])), 6.0)
    lo = np.searchsorted(_MIDPOINTS, mag, side="left")  # the lower code on a tie
    hi = np.searchsorted(_MIDPOINTS, mag, side="right")
    code = np.where((lo != hi) & (lo % 2 == 1), hi, lo).astype(np.uint8) | (np.signbit(w).astype(np.uint8) << 3)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exp + SCALE_BIAS).astype(np.uint8)


BLOCKS, SCALES = "_blocks", "_scales"  # a quantized tensor's name on the hub is its name plus these


def blocks_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The hub's `*_blocks` shape of a tensor whose in-memory shape is [..., in, out] (transformers' x @ W)."""
    *lead, n_in, n_out = shape
    return (*lead, n_out, n_in // 32, 16)
