"""The learning-rate schedule: linear warmup, then cosine, linear, constant or warmup-stable-decay.

`wsd` holds the peak rate after warmup and decays only at the end, so one stable run serves every
token budget: a cooldown branch resumes its checkpoint at step S with `optim.decay_start=S` and a
larger `train.max_steps`. The decay is 1-sqrt (Hägele et al. 2024, "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations": it matches cosine at every budget, linear falls short),
and reaches min_lr at the last step."""

from __future__ import annotations

import math

from .config import RunConfig


def wsd_decay_start(cfg: RunConfig) -> int:
    """The first step of the wsd decay: `optim.decay_start`, else the last `decay_fraction` of max_steps."""
    o = cfg.optim
    if o.decay_start is not None:
        return o.decay_start
    return max(o.warmup_steps, cfg.max_steps - round(o.decay_fraction * cfg.max_steps))


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.decay == "constant":
        return o.lr
    if o.decay == "wsd":
        start = wsd_decay_start(cfg)
        if step < start:
            return o.lr
        progress = min(1.0, (step - start + 1) / max(1, cfg.max_steps - start))
        return o.min_lr + (o.lr - o.min_lr) * (1.0 - math.sqrt(progress))
    span = o.decay_steps if o.decay_steps is not None else max(1, cfg.max_steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / max(1, span))
    if o.decay == "linear":
        return o.lr - (o.lr - o.min_lr) * progress
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
