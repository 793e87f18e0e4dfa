"""Next-token loss: the masked cross-entropy training minimises, and the validation loss over a split.

Training and evaluation both use it; it lives apart from evaluate.py so that a change to decoding or
tasks leaves the train step's code version alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import ModelConfig, UserError
from trainer.train.data import eval_batches
from trainer.model.decoder import Transformer, logits_of
from trainer.model.sharding import BATCH_AXES

Array = jax.Array


def token_loss(logits: Array, targets: Array, mask: Array) -> tuple[Array, Array]:
    """Sum of float32 next-token cross-entropies where mask > 0, and the number of such positions."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    keep = mask > 0
    return jnp.sum(jnp.where(keep, losses, 0.0)), jnp.sum(keep, dtype=jnp.float32)


def tiled_token_loss(
    cfg: ModelConfig, x: Array, kernel: Array, targets: Array, mask: Array, tiles: int = 1
) -> tuple[Array, Array]:
    """token_loss of the logits of hidden states x [batch, seq, embed] through the head `kernel`, `tiles` sequence
    tiles at a time: no whole float32 [batch, seq, vocab] logits exist, forward or backward (MaxText's vocabulary
    tiling). The backward pass recomputes each tile's logits."""
    logits = lambda h: nn.with_logical_constraint(logits_of(cfg, kernel, h), ("batch", "length", "vocab"))  # noqa: E731
    if tiles == 1:
        return token_loss(logits(x), targets, mask)
    batch, seq = targets.shape
    if seq % tiles:
        raise UserError(f"train.vocab_tiling ({tiles}) must divide the sequence length ({seq})")

    def split(a: Array) -> Array:  # [batch, seq, ...] -> [tiles, batch, seq / tiles, ...]: each tile keeps the batch
        return a.reshape(batch, tiles, seq // tiles, *a.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def tile(sums: tuple[Array, Array], inputs: tuple[Array, Array, Array]) -> tuple[tuple[Array, Array], None]:
        total, count = token_loss(logits(inputs[0]), inputs[1], inputs[2])
        return (sums[0] + total, sums[1] + count), None

    zero = jnp.zeros((), jnp.float32)
    sums, _ = jax.lax.scan(tile, (zero, zero), (split(x), split(targets), split(mask)))
    return sums


@functools.cache
def _loss_step(cfg_json: str) -> Callable:
    """One jitted (params, batch) -> (loss sum, token count, scored rows) per model config."""
    model = Transformer(ModelConfig.model_validate_json(cfg_json))

    @jax.jit
    def step(params: Any, batch: dict[str, Array]) -> tuple[Array, Array, Array]:
        logits = model.apply({"params": params}, batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
        total, count = token_loss(logits, batch["targets"], batch["mask"])
        return total, count, jnp.sum(jnp.any(batch["mask"] > 0, axis=-1))

    return step


def validation_loss(
    params: Any, cfg: ModelConfig, paths: list[str], batch_size: int, max_batches: int = 0, mesh: Mesh | None = None
) -> dict:
    """Token-weighted mean next-token cross-entropy over the split: {"loss", "perplexity", "tokens", "sequences"}.

    With a mesh, batches are split over its batch axes and params not already on it are replicated onto it.
    """
    step = _loss_step(cfg.model_dump_json())
    batch_sharding = None
    if mesh is not None:
        params, batch_sharding = _on_mesh(params, mesh, batch_size)
    # Keep results on device and read them at the end, so batches are dispatched without waiting.
    results = []
    for batch in eval_batches(paths, batch_size, max_batches):
        if batch_sharding is not None:
            batch = jax.device_put(batch, batch_sharding)
        results.append(step(params, batch))
    total, tokens, sequences = np.sum(jax.device_get(results), axis=0, dtype=np.float64) if results else np.zeros(3)
    if not tokens:
        raise UserError(f"the validation shards ({len(paths)} files) hold no tokens to score")
    loss = float(total / tokens)
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "tokens": int(tokens),
        "sequences": int(sequences),
    }


def _on_mesh(params: Any, mesh: Mesh, batch_size: int) -> tuple[Any, NamedSharding]:
    """Params not yet laid out on `mesh` replicated onto it, and the batch sharding (replicated if it can't split)."""
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())
    placed = lambda x: isinstance(x, jax.Array) and x.sharding.device_set == devices  # noqa: E731
    params = jax.tree.map(lambda x: x if placed(x) else jax.device_put(x, replicated), params)
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    ways = math.prod(mesh.shape[a] for a in axes)
    return params, NamedSharding(mesh, PartitionSpec(axes) if axes and batch_size % ways == 0 else PartitionSpec())
