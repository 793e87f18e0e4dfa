"""The per-layer pattern: which layers attend globally or through the sliding window, which have experts, and the
scanned unit the pattern repeats in.

Layers scan as one `nn.scan` over units of `len(unit_kinds(cfg))` consecutive layers. A unit is one layer unless
layers of different shapes alternate: dense and MoE layers (every moe_every-th is MoE), or global layers whose
heads differ from the local ones' (Gemma 4: 512-wide heads, fewer of them, keys as values). Each block of a unit
then has its own parameters, under layers/block_{j}, stacked over the units. Where global and local layers share
shapes (Gemma 2/3, GPT-OSS), a layer's kind is a scanned input instead (LayerKind.is_global None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from configs import ModelConfig


@dataclass(frozen=True)
class LayerKind:
    """One block of the scanned unit: global (True), local (False) or either by a scanned input (None); MoE or not."""

    is_global: bool | None
    sparse: bool


def layer_is_global(cfg: ModelConfig) -> np.ndarray:
    """Per layer: True where it attends to the whole context, False where it uses the sliding window."""
    i = np.arange(cfg.num_layers)
    if not cfg.sliding_window:
        return np.ones(cfg.num_layers, bool)
    return (i + 1) % cfg.global_every == 0 if cfg.global_every else np.zeros(cfg.num_layers, bool)


def layer_is_moe(cfg: ModelConfig) -> np.ndarray:
    """Per layer: True where its MLP is a Mixture of Experts (every moe_every-th layer of an MoE model)."""
    return (np.arange(cfg.num_layers) + 1) % cfg.moe_every == 0 if cfg.moe else np.zeros(cfg.num_layers, bool)


def global_shapes_differ(cfg: ModelConfig) -> bool:
    """Whether global layers' attention has other shapes than local layers' (so they cannot stack together)."""
    return head_geometry(cfg, True) != head_geometry(cfg, False)


def head_geometry(cfg: ModelConfig, is_global: bool | None) -> tuple[int, int, bool]:
    """(head_dim, kv heads, keys reused as values) of a global or local layer's attention (None: either)."""
    if is_global:
        return cfg.global_head_dim or cfg.head_dim, cfg.global_num_kv_heads or cfg.num_kv_heads, cfg.global_k_eq_v
    return cfg.head_dim, cfg.num_kv_heads, False


def unit_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    """The kinds of the blocks of one scanned unit, in order; the unit repeats num_layers / len(...) times."""
    glob, sparse = layer_is_global(cfg), layer_is_moe(cfg)
    kinds = set(glob.tolist())
    static = len(kinds) == 1 or global_shapes_differ(cfg)
    size = cfg.moe_every if cfg.moe else 1
    if static and len(kinds) == 2:
        size = math.lcm(size, cfg.global_every)
    if cfg.num_layers % size:
        raise ValueError(f"the layer pattern repeats every {size} layers, which does not divide model.num_layers "
                         f"({cfg.num_layers})")
    return tuple(LayerKind(bool(glob[j]) if static else None, bool(sparse[j])) for j in range(size))


def unit_count(cfg: ModelConfig) -> int:
    """How many times the unit repeats: the length of the scan."""
    return cfg.num_layers // len(unit_kinds(cfg))
