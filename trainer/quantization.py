"""Quantized training (train.quantization): the layers' projection and MLP matmuls in int8 or fp8, through Qwix.

Qwix is the JAX quantization library MaxText moved to from AQT (`use_qwix_quantization`); it intercepts
the matmuls of an unchanged Flax model, so params, checkpoints and exports stay ordinary float arrays.
Each matmul quantizes its operands per channel (absmax) in the forward pass and the incoming gradient in
the backward pass; gradients reach the float weights straight through the rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn
import qwix

from configs import UserError

# Attention's q/k/v/o projections, the dense MLP and the experts' matmuls of every layer (grouped under
# block_j when MoE layers interleave). Not the embedding, the output head or an MoE router, whose top-k is a
# discrete choice that rounding would flip, and not attention's score and value products.
LAYER_MATMULS = r"layers/(block_\d+/)?(attn/[qkvo]_proj|mlp/(gate|up|down)_proj|moe)"

_QTYPES = {  # forward (weights and activations), backward (gradients)
    "int8": (jnp.int8, jnp.int8),
    "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2),
}


def quantize(model: nn.Module, mode: str) -> nn.Module:
    """`model` with its layer matmuls quantized to `mode` (int8 | fp8) in training; `none` returns it unchanged."""
    if mode == "none":
        return model
    forward, backward = _QTYPES[mode]
    rule = qwix.QtRule(
        module_path=LAYER_MATMULS, weight_qtype=forward, act_qtype=forward, bwd_qtype=backward,
        op_names=("dot_general", "einsum", "ragged_dot"),
    )
    return qwix.quantize_model(model, qwix.QtProvider([rule]))


def check_quantization(mode: str, device: jax.Device) -> str:
    """Refuse (UserError) a mode the device cannot run; return a warning line ("" if none)."""
    if mode != "fp8":
        return ""
    if device.platform == "cpu":
        return "fp8 on CPU is emulated: the numerics of fp8 training, none of its speed"
    if device.platform == "gpu":
        capability = getattr(device, "compute_capability", "")
        if capability and tuple(int(x) for x in capability.split(".")) < (8, 9):
            raise UserError(
                f"train.quantization=fp8 needs a GPU with fp8 matmuls (compute capability 8.9+: Ada, Hopper, "
                f"Blackwell); this {device.device_kind} is {capability}: use int8 or none"
            )
    return ""
