"""AdamW with linear warmup + cosine decay, global-norm clipping and a non-finite-update guard (optax)."""
from __future__ import annotations

import functools

import jax
import optax

from k3jax.train.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate` over `warmup_steps`, cosine to `learning_rate*min_lr_ratio`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio)


def _decay_mask(params):
    # Weight decay on matrices only: not on norm scales, biases, pseudo-queries, gates' A_log/dt_bias.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


@functools.cache
def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """The training optimizer.

    `optax.apply_if_finite` skips any update whose gradients contain inf/NaN and counts consecutive
    skips in its state (`notfinite_count`); the trainer stops after `max_nonfinite_steps` in a row.

    Cached on the frozen `cfg`: runs with equal TrainConfigs (e.g. seeds of one experiment in one
    process) get the SAME optax object, so their `nnx.Optimizer` graph definitions are equal and
    `nnx.jit(train_step)` reuses the executable of the first run instead of re-tracing and compiling
    (optax objects compare equal only to themselves). Sharing is safe: a transformation is a pair of
    pure functions; its state lives in the optimizer.
    """
    inner = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                    mask=_decay_mask),
    )
    # max_consecutive_errors is set past the trainer's own stop so optax never forces a bad update.
    return optax.apply_if_finite(inner, max_consecutive_errors=cfg.max_nonfinite_steps + 1)
