"""Where a parameter lives in a HF checkpoint: its name, shape and conversions both ways (TensorSpec), and the
helpers ingest and export use on any family's specs.

HF stores torch Linear weights as [out, in]; ours are [in, out] with the head axis split out. Stacked
parameters (under `layers`) hold one HF tensor per layer, and an expert parameter one per layer and expert
(or transformers 5's in-memory tensor of all a layer's experts). A HF tensor that holds several of our
parameters (GPT-OSS's interleaved gate and up columns) has one spec per parameter, sharing its name, each with
`join` to build the HF tensor from all of them on export.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from configs import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    """One parameter: where it lives in our tree and in the HF checkpoint, and how to convert it."""

    path: tuple[str, ...]  # our param path; under "layers" it is stacked over a leading layer axis
    hf_name: str  # "{i}" stands for the layer index, "{e}" for the expert's (stacked over a second axis)
    hf_shape: tuple[int, ...]  # of one tensor (one layer's, one expert's)
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    # transformers 5's name in memory ("{i}"), where it differs from the name on disk; for experts, the tensor of
    # all the layer's experts, in which each expert has `fused[1]` slices of hf_shape and this is slice `fused[0]`.
    memory_name: str = ""
    fused: tuple[int, int] = (0, 1)
    layers: tuple[int, ...] = ()  # the layers stacked here, when not all (interleaved dense and MoE layers)
    # When the HF tensor holds several of our parameters: the HF tensor from all of them (the specs sharing hf_name,
    # in order); to_ours then takes this parameter's part of the whole HF tensor.
    join: Callable[[list[np.ndarray]], np.ndarray] | None = None

    @property
    def whole(self) -> bool:
        """Whether ingest reads the HF tensor whole and converts it in memory (a layer's tensor of all experts),
        rather than row by row into place (a reshape or a 2-D transpose)."""
        return self.join is not None or len(self.hf_shape) > 2

    @property
    def stacked(self) -> bool:
        return self.path[0] == "layers"

    @property
    def experts(self) -> bool:
        return "{e}" in self.hf_name


def same(w: np.ndarray) -> np.ndarray:
    return w


def t(w: np.ndarray) -> np.ndarray:
    return w.T


def heads_in(d: int, n: int, hd: int) -> tuple[Callable, Callable]:
    """[n * hd, d] <-> [d, n, hd]: a q/k/v projection."""
    return lambda w: w.T.reshape(d, n, hd), lambda k: k.reshape(d, n * hd).T


def heads_out(d: int, n: int, hd: int) -> tuple[Callable, Callable]:
    """[d, n * hd] <-> [n, hd, d]: the output projection."""
    return lambda w: w.T.reshape(n, hd, d), lambda k: k.reshape(n * hd, d).T


def heads_bias(n: int, hd: int) -> tuple[Callable, Callable]:
    """[n * hd] <-> [n, hd]: a q/k/v projection's bias."""
    return lambda w: w.reshape(n, hd), lambda b: b.reshape(n * hd)


def is_transposed(spec: TensorSpec) -> bool:
    """Whether to_ours is w.T reshaped (else it is w reshaped: the same bytes in the same order)."""
    probe = np.empty(spec.hf_shape, np.uint8)
    return len(spec.hf_shape) == 2 and not spec.to_ours(probe).flags.c_contiguous


def _ours_shape(spec: TensorSpec) -> tuple[int, ...]:
    return spec.to_ours(np.empty(spec.hf_shape, np.uint8)).shape


def stacked_layers(spec: TensorSpec, cfg: ModelConfig) -> tuple[int, ...]:
    """The layers a stacked parameter holds, in order (none when not stacked)."""
    return (spec.layers or tuple(range(cfg.num_layers))) if spec.stacked else ()


def stacked_shape(spec: TensorSpec, cfg: ModelConfig) -> tuple[int, ...]:
    """Our parameter's shape: with leading layer (and expert) axes when scanned."""
    stack = (len(stacked_layers(spec, cfg)),) * spec.stacked + (cfg.num_experts,) * spec.experts
    return (*stack, *_ours_shape(spec))


def hf_names(spec: TensorSpec, cfg: ModelConfig) -> list[str]:
    """The tensor's names in the HF checkpoint: one per layer when stacked, per expert of each layer for experts."""
    layers = stacked_layers(spec, cfg)
    if spec.experts:
        return [spec.hf_name.format(i=i, e=e) for i in layers for e in range(cfg.num_experts)]
    return [spec.hf_name.format(i=i) for i in layers] if spec.stacked else [spec.hf_name]


def in_memory(spec: TensorSpec, cfg: ModelConfig, index: int) -> tuple[str, tuple[int, ...], int]:
    """Where hf_names(spec, cfg)[index] lies in transformers' in-memory tensors: (name, shape, first row),
    a row being hf_shape[1:]."""
    layers = stacked_layers(spec, cfg)
    if not spec.experts:
        return spec.memory_name.format(i=layers[index]), spec.hf_shape, 0
    layer, expert = divmod(index, cfg.num_experts)
    slot, slots = spec.fused
    shape = (cfg.num_experts, slots * spec.hf_shape[0], *spec.hf_shape[1:])
    return spec.memory_name.format(i=layers[layer]), shape, (expert * slots + slot) * spec.hf_shape[0]

