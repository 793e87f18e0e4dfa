"""Quantized training (train.quantization): the layers' projection, MLP and expert matmuls in int8 or fp8, via Qwix.

int8: weights, activations and incoming gradients in int8. fp8: weights and activations in float8_e4m3fn, the
incoming gradients in float8_e5m2 (more range, less precision: MaxText's `fp8_full` recipe). Each matmul scales
its operands per channel by their absolute maximum on the fly; gradients reach the float weights straight through
the rounding. Master weights, optimizer state, checkpoints and exports stay ordinary float arrays.

Why Qwix, not AQT: Qwix (google/qwix, 0.1.8) intercepts the `dot_general`, `einsum` and `ragged_dot` calls of an
unchanged Flax model by module path, so model.py needs no quantization code and the params tree does not change.
MaxText recommends it (`use_qwix_quantization`) and is removing AQT (its docs/aqt_deprecation_phase_2 plan).
aqtp 0.9.0 (Aug 2025, unpinned jax/flax) does import and build an `AqtDotGeneral` Dense with our jax 0.10.2 and
flax 0.12.8, but needs a `dot_general_cls` threaded into every Dense and einsum of the model.

Where it runs (check_quantization):
- int8: on every device. XLA:TPU compiles the quantized matmuls to s8 x s8 -> s32 convolutions (and s8 ragged-dot
  custom calls for dropless MoE): checked by compiling the train step with libtpu 0.0.42 for v4, v5e, v5p and v6e.
- fp8 on NVIDIA GPUs: compute capability 8.9+ (Ada, Hopper, Blackwell), which have fp8 tensor cores; refused on
  older GPUs and on GPUs that report no CUDA capability (AMD's MI300 use the other fp8 flavour, e4m3fnuz).
- fp8 on TPU: allowed, with a warning before TPU7x (Ironwood: 4,614 fp8 TFLOP/s against 2,307 bf16, where v5p and
  v6e list the same peak for fp8 as for bf16; cloud.google.com/tpu/docs/tpu7x):
  XLA:TPU compiles the f8 x f8 matmuls on v4-v6e too (same libtpu check), and MaxText's tests run its Qwix fp8
  recipe on TPU, but those chips' fast 8-bit type is int8.
- fp8 on CPU: emulated, for its numerics only (the tests check them there).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import flax.linen as nn
import qwix

from configs import UserError

# Attention's q/k/v/o projections, the dense MLP and the experts' matmuls of every layer (grouped under
# block_j when MoE layers interleave). Not the embedding, the output head or an MoE router (its own module,
# layers/moe/router), whose top-k is a discrete choice that rounding would flip, and not attention's score and
# value products. The MoE module's only matmuls are its experts' (moe.combine and moe.router_stats are sums).
LAYER_MATMULS = r"layers/(block_\d+/)?(attn/[qkvo]_proj|mlp/(gate|up|down)_proj|moe)"

_QTYPES = {  # forward (weights and activations), backward (incoming gradients)
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
    if device.platform == "tpu":
        if re.search(r"\bv[2-6]", device.device_kind.lower()):
            return (f"{device.device_kind} has no fp8 matmul throughput (TPU7x has): fp8 trains with fp8's numerics "
                    f"but no 8-bit speed-up; int8 is this chip's fast 8-bit type")
        return ""
    capability = _cuda_capability(device)
    if capability is None or capability < (8, 9):
        have = getattr(device, "compute_capability", "") or "unknown"
        raise UserError(
            f"train.quantization=fp8 needs an NVIDIA GPU with fp8 matmuls (compute capability 8.9+: Ada, Hopper, "
            f"Blackwell); this {device.device_kind} is {have}: use int8 or none"
        )
    return ""


def _cuda_capability(device: jax.Device) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA GPU's compute capability; None where the device reports none."""
    match = re.fullmatch(r"(\d+)\.(\d+)", str(getattr(device, "compute_capability", "")))
    return (int(match[1]), int(match[2])) if match else None
