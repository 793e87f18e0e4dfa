"""Where each parameter lives in a HF checkpoint: per-family tensor names, shapes and conversions.

HF stores torch Linear weights as [out, in]; ours are [in, out] with the head axis split out
(see `trainer/model/decoder.py`). Both sides pair RoPE dimensions by halves (rotate_half), so q/k need no permutation.
A Mixture of Experts' expert weights are stacked over [layers, experts] here and one tensor per expert on
disk; transformers 5 holds each layer's experts in memory as one tensor (gate and up fused), which ingest also reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

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

    @property
    def stacked(self) -> bool:
        return self.path[0] == "layers"

    @property
    def experts(self) -> bool:
        return "{e}" in self.hf_name


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every parameter of the model, in the order the HF export writes them."""
    d, v = cfg.emb_dim, cfg.vocab_size
    specs = [TensorSpec(("embed", "embedding"), "model.embed_tokens.weight", (v, d), _same, _same)]
    group = cfg.moe_every if cfg.moe else 1
    if group == 1:
        specs += _block_specs(cfg, cfg.moe)
    else:  # interleaved: blocks j, j + group, ... stacked under layers/block_{j} (see trainer/model/decoder.py Blocks)
        for j in range(group):
            layers = tuple(range(j, cfg.num_layers, group))
            specs += [replace(spec, path=("layers", f"block_{j}", *spec.path[1:]), layers=layers)
                      for spec in _block_specs(cfg, sparse=j == group - 1)]
    specs.append(TensorSpec(("final_norm", "scale"), "model.norm.weight", (d,), _same, _same))
    if not cfg.tie_embeddings:
        specs.append(TensorSpec(("lm_head", "kernel"), "lm_head.weight", (v, d), _t, _t))
    return specs


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _t(w: np.ndarray) -> np.ndarray:
    return w.T


def _block_specs(cfg: ModelConfig, sparse: bool) -> list[TensorSpec]:
    """One transformer block's parameters (stacked under `layers`), with an MoE MLP when `sparse`."""
    d, m, hd = cfg.emb_dim, cfg.mlp_dim, cfg.head_dim
    same, t = _same, _t

    def heads_in(n: int) -> tuple[Callable, Callable]:  # [n*hd, d] <-> [d, n, hd]
        return lambda w: w.T.reshape(d, n, hd), lambda k: k.reshape(d, n * hd).T

    heads_out = (  # [d, h*hd] <-> [h, hd, d]
        lambda w: w.T.reshape(cfg.num_heads, hd, d),
        lambda k: k.reshape(cfg.num_heads * hd, d).T,
    )
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = "model.layers.{i}."
    specs = [
        TensorSpec(("layers", "attn_norm", "scale"), layer + "input_layernorm.weight", (d,), same, same),
        TensorSpec(("layers", "attn", "q_proj", "kernel"), layer + "self_attn.q_proj.weight", (q, d),
                *heads_in(cfg.num_heads)),
        TensorSpec(("layers", "attn", "k_proj", "kernel"), layer + "self_attn.k_proj.weight", (kv, d),
                *heads_in(cfg.num_kv_heads)),
        TensorSpec(("layers", "attn", "v_proj", "kernel"), layer + "self_attn.v_proj.weight", (kv, d),
                *heads_in(cfg.num_kv_heads)),
        TensorSpec(("layers", "attn", "o_proj", "kernel"), layer + "self_attn.o_proj.weight", (d, q), *heads_out),
    ]
    if cfg.qk_norm:
        specs += [
            TensorSpec(("layers", "attn", "q_norm", "scale"), layer + "self_attn.q_norm.weight", (hd,), same, same),
            TensorSpec(("layers", "attn", "k_norm", "scale"), layer + "self_attn.k_norm.weight", (hd,), same, same),
        ]
    if cfg.post_norms:  # Gemma 2/3 name the norm after attention post_attention_layernorm, unlike Llama
        specs += [
            TensorSpec(("layers", "attn_post_norm", "scale"), layer + "post_attention_layernorm.weight", (d,), same, same),
            TensorSpec(("layers", "mlp_norm", "scale"), layer + "pre_feedforward_layernorm.weight", (d,), same, same),
            TensorSpec(("layers", "mlp_post_norm", "scale"), layer + "post_feedforward_layernorm.weight", (d,), same, same),
        ]
    else:
        specs.append(TensorSpec(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", (d,), same, same))
    return specs + (_moe_specs(cfg, layer) if sparse else [
        TensorSpec(("layers", "mlp", "gate_proj", "kernel"), layer + "mlp.gate_proj.weight", (m, d), t, t),
        TensorSpec(("layers", "mlp", "up_proj", "kernel"), layer + "mlp.up_proj.weight", (m, d), t, t),
        TensorSpec(("layers", "mlp", "down_proj", "kernel"), layer + "mlp.down_proj.weight", (d, m), t, t),
    ])


def _moe_specs(cfg: ModelConfig, layer: str) -> list[TensorSpec]:
    """The router and experts: Mixtral's block_sparse_moe (renamed mlp in memory) or Qwen3-MoE's mlp on disk."""
    d, f, n, t = cfg.emb_dim, cfg.expert_width, cfg.num_experts, _t
    on_disk, in_memory = layer + ("block_sparse_moe." if cfg.family == "mixtral" else "mlp."), layer + "mlp."
    gate, up, down = ("w1", "w3", "w2") if cfg.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    expert = on_disk + "experts.{e}."
    return [
        TensorSpec(("layers", "moe", "router", "kernel"), on_disk + "gate.weight", (n, d), t, t,
                   memory_name=in_memory + "gate.weight"),
        TensorSpec(("layers", "moe", "gate_proj"), expert + gate + ".weight", (f, d), t, t,
                   memory_name=in_memory + "experts.gate_up_proj", fused=(0, 2)),
        TensorSpec(("layers", "moe", "up_proj"), expert + up + ".weight", (f, d), t, t,
                   memory_name=in_memory + "experts.gate_up_proj", fused=(1, 2)),
        TensorSpec(("layers", "moe", "down_proj"), expert + down + ".weight", (d, f), t, t,
                   memory_name=in_memory + "experts.down_proj"),
    ]



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

