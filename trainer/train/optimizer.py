"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from configs import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to the peak rate, then cosine decay to peak * min_lr_ratio at the last step."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps,
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; weight decay applies to matrices, not to norm scales."""
    clip = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(
        *clip,
        optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=_decay_mask),
    )


def _decay_mask(params: dict) -> dict:
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key != "scale", params)
