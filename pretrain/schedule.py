"""The learning-rate schedule: linear warmup, then cosine, linear or constant decay to min_lr."""

from __future__ import annotations

import math

from .config import RunConfig


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.decay == "constant":
        return o.lr
    span = o.decay_steps if o.decay_steps is not None else max(1, cfg.max_steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / max(1, span))
    if o.decay == "linear":
        return o.lr - (o.lr - o.min_lr) * progress
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
