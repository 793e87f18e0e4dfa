"""Attention kernels: XLA's dense attention, cuDNN flash attention (NVIDIA GPUs), Pallas splash attention (TPU).

Every kernel computes the same function: causal grouped-query attention over [batch, seq, heads, head_dim],
optionally limited to a sliding window of the latest `window` tokens and to the query's own document
(segment ids), with the scores scaled and optionally soft-capped (cap * tanh(score / cap)), and optionally a
learned sink logit per head joining every softmax row (GPT-OSS: it takes probability and gives no value).
`choose` picks the kernel for a model config and the devices it runs on; where a kernel cannot compute what the
config asks, it picks XLA and says why, so a run never gets a silently different result.

With context parallelism (the mesh's `context` axis > 1) the queries stay split over `context` and the keys and values
are all-gathered; splash then expects the sequence reordered by context.load_balance.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import ModelConfig, UserError
from trainer.model.context import restore_order, token_order
from trainer.model.sharding import BATCH_AXES

Array = jax.Array
SPLASH_BLOCKS = (512, 256, 128)  # splash tiles: the largest that divides the sequence (TPU lanes are 128 wide)


def choose(
    requested: str, cfg: ModelConfig, device: jax.Device, seq_len: int, tensor: int = 1, context: int = 1
) -> tuple[str, str]:
    """The kernel for `model.attention` on `device`'s platform, and why it is XLA when that was not the plan.

    `auto` picks cuDNN on NVIDIA GPUs, splash on TPUs and XLA elsewhere. Asking for a kernel the devices
    cannot run is an error; asking for one that cannot do this model's attention falls back to XLA.
    `tensor` and `context` are the mesh's sizes of those axes.
    """
    platform = device.platform
    nvidia = platform == "gpu" and "nvidia" in device.device_kind.lower()
    if requested == "cudnn" and not nvidia:
        raise UserError(f"model.attention=cudnn needs an NVIDIA GPU; this run's devices are {device.device_kind} "
                        "(use model.attention=auto or xla)")
    if requested == "splash" and platform != "tpu":
        raise UserError(f"model.attention=splash needs a TPU; this run's devices are {device.device_kind} "
                        "(use model.attention=auto or xla)")
    kernel = requested if requested != "auto" else "cudnn" if nvidia else "splash" if platform == "tpu" else "xla"
    limits = {"cudnn": _cudnn_limits, "splash": _splash_limits}.get(kernel, lambda *_: "")
    why = limits(cfg, device, seq_len, tensor, context)
    return ("xla", why) if why else (kernel, "")


def _cudnn_limits(cfg: ModelConfig, device: jax.Device, seq_len: int, tensor: int, context: int) -> str:
    """Why cuDNN flash attention (as jax.nn.dot_product_attention drives it) cannot run this model; "" if it can."""
    if context > 1:
        return (f"jax's cuDNN attention refuses a sequence split over train.mesh context={context} and has no causal "
                "mask for a shard's queries")
    hopper = tuple(int(x) for x in str(getattr(device, "compute_capability", "9.0")).split(".")) >= (9, 0)
    max_dim = 256 if hopper else 128
    if cfg.dtype != "bfloat16":
        return f"cuDNN flash attention computes in bfloat16 or float16, and model.dtype is {cfg.dtype}"
    if cfg.attn_softcap:
        return f"cuDNN flash attention cannot soft-cap scores (model.attn_softcap={cfg.attn_softcap:g})"
    if cfg.attention_sinks:
        return "jax.nn.dot_product_attention's cuDNN path has no attention sinks (model.attention_sinks)"
    for name in ("head_dim", "global_head_dim"):
        dim = getattr(cfg, name)
        if dim and (dim % 8 or dim > max_dim):
            return (f"cuDNN flash attention on {device.device_kind} takes head_dim <= {max_dim}, a multiple of 8 "
                    f"(model.{name}={dim})")
    return ""


def _splash_limits(cfg: ModelConfig, device: jax.Device, seq_len: int, tensor: int, context: int) -> str:
    """Why the splash kernel cannot run this model; "" if it can."""
    if context > 1 and seq_len % (SPLASH_BLOCKS[-1] * context):
        return f"splash attention tiles each context shard's {seq_len} / {context} tokens by {SPLASH_BLOCKS[-1]}"
    if seq_len % SPLASH_BLOCKS[-1]:
        return f"splash attention tiles sequences by {SPLASH_BLOCKS[-1]} tokens and they are {seq_len}"
    for name in ("num_kv_heads", "global_num_kv_heads"):
        heads = getattr(cfg, name)
        if heads and heads % tensor:
            return (f"splash attention runs per device and the {heads} kv heads do not split over "
                    f"train.mesh tensor={tensor}")
    return ""


def xla_attention(
    q: Array, k: Array, v: Array, mask: Array | None, causal: bool, scale: float, softcap: float,
    sinks: Array | None = None,
) -> Array:
    """XLA's attention, scores materialised; `mask` is a dense [batch, 1, q, k] mask (None: none beyond `causal`),
    `sinks` [heads] a logit per head joining each softmax row (None: none)."""
    if not softcap and sinks is None:  # jax.nn's XLA path groups the kv heads itself
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, scale=scale, implementation="xla")
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    if causal:
        mask = jnp.tril(jnp.ones((t, k.shape[1]), bool))[None, None] & (True if mask is None else mask)
    if mask is not None:
        scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is not None:  # the sink's column takes its share of each row's softmax, then is dropped
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv, h // kv, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    else:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)


def flash_attention(
    kernel: str, q: Array, k: Array, v: Array, segment_ids: Array | None, *,
    scale: float, softcap: float, window: int, sinks: Array | None = None, mesh: Mesh | None = None,
) -> Array:
    """Causal attention of a training forward pass through cuDNN or splash; `window` 0 means the whole context.

    Splash is a per-device Pallas kernel: on a mesh it runs under shard_map, batch split over data x fsdp x expert,
    heads over tensor and queries over context (keys and values all-gathered), as the activations are laid out (see
    sharding.RULES). Off a TPU it runs in Pallas's interpreter (tests).
    """
    cp = _context(mesh)
    if kernel == "cudnn":
        if sinks is not None or cp > 1:
            raise ValueError("cuDNN flash attention has no attention sinks nor context parallelism (kernels.choose "
                             "picks XLA for them)")
        return _cudnn(q, k, v, segment_ids, scale, window)
    if kernel != "splash":
        raise ValueError(f"flash_attention runs cudnn or splash, not {kernel!r}")
    interpret = _platform(mesh) != "tpu"
    if mesh is None or mesh.size == 1:
        splash = _splash_kernel(q.shape[1], q.shape[2], window, softcap, interpret)
        return _splash(splash, q, k, v, segment_ids, segment_ids, sinks, scale)
    splash = _splash_kernel(q.shape[1], q.shape[2] // mesh.shape["tensor"], window, softcap, interpret, cp)
    queries = PartitionSpec(BATCH_AXES, "context", "tensor", None)
    keys = PartitionSpec(BATCH_AXES, None, "tensor", None)  # whole sequences: all-gathered over context
    # The kernel's mask info is cut along the queries, one part per context shard.
    operands = [splash, q, k, v]
    specs = [splash.manual_sharding_spec(NamedSharding(mesh, PartitionSpec(None, "context"))), queries, keys, keys]
    if segment_ids is not None:
        operands += [segment_ids, segment_ids]
        specs += [PartitionSpec(BATCH_AXES, "context"), PartitionSpec(BATCH_AXES, None)]
    if sinks is not None:
        operands, specs = operands + [sinks], specs + [PartitionSpec("tensor")]

    def per_device(splash: Any, q: Array, k: Array, v: Array, *rest: Array) -> Array:
        q_segments, kv_segments = rest[:2] if segment_ids is not None else (None, None)
        if cp > 1:  # the kernel's mask takes keys in order (its queries carry their positions)
            k, v = restore_order(k, cp), restore_order(v, cp)
            kv_segments = None if kv_segments is None else restore_order(kv_segments, cp)
        return _splash(splash, q, k, v, q_segments, kv_segments, rest[-1] if sinks is not None else None, scale)

    return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs), out_specs=queries, check_vma=False)(*operands)


def _platform(mesh: Mesh | None) -> str:
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def _context(mesh: Mesh | None) -> int:
    return mesh.shape.get("context", 1) if mesh is not None else 1


def _cudnn(q: Array, k: Array, v: Array, segment_ids: Array | None, scale: float, window: int) -> Array:
    """cuDNN flash attention: the causal mask and the window as cuDNN's own masks, documents as a dense mask."""
    mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=True,
        local_window_size=(window - 1, 0) if window else None, implementation="cudnn",
    )


def _splash_kernel(seq: int, heads: int, window: int, softcap: float, interpret: bool, cp: int = 1) -> Any:
    """Splash attention over `seq` tokens for `heads` heads; with `cp` > 1, for queries reordered by
    context.load_balance and cut into `cp` shards (the mask info too: see manual_sharding_spec), keys in order."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (seq, seq)
    mask = masks.LocalMask(shape, (window - 1, 0), 0) if window else masks.CausalMask(shape)
    if cp > 1:  # the mask's rows are the queries' positions (MaxText's LoadBalancedCausalMask does the same)
        mask.q_sequence = token_order(seq, cp).astype(np.int32)
    per_shard = seq // cp
    block = next((b for b in SPLASH_BLOCKS if per_shard % b == 0), per_shard)
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * heads), head_shards=1, q_seq_shards=cp, interpret=interpret,
        block_sizes=splash.BlockSizes(
            block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
            block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
        ),
        attn_logits_soft_cap=softcap or None,
    )


def _splash(
    kernel: Any, q: Array, k: Array, v: Array, q_segments: Array | None, kv_segments: Array | None,
    sinks: Array | None, scale: float,
) -> Array:
    """Splash attention on one device's [batch, seq, heads, head_dim] shard (the kernel takes heads first)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    heads_first = lambda x: x.swapaxes(1, 2)  # noqa: E731
    q, k, v = heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v)
    if q_segments is None:
        out = jax.vmap(lambda q, k, v: kernel(q, k, v, sinks=sinks))(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, sq, skv: kernel(q, k, v, segment_ids=SegmentIds(sq, skv), sinks=sinks))(
            q, k, v, q_segments, kv_segments)
    return heads_first(out)
