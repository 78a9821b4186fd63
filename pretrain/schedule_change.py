"""A resume under another learning-rate schedule than its checkpoint's: natural when every step already
trained keeps its rate (a longer constant or wsd stable phase, a cooldown branch), else refused unless
`optim.allow_schedule_change`; either way the log says what changed and the next step's rate under both."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from common.errors import RecipeError

from .config import OptimConfig, RunConfig, TrainConfig
from .loop import lr_at
from .resume import ResumePoint

SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay", "decay_steps", "decay_fraction", "decay_start")


def _recorded_schedule(cfg: RunConfig, recipe: dict[str, Any]) -> RunConfig:
    """`cfg` with the train and optim sections a checkpoint's recipe records (the fields this version
    knows; one it lacks keeps its default, as with_new_defaults treats an older config.yaml)."""

    def section(cls, values: dict[str, Any] | None):
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in known})

    return dataclasses.replace(
        cfg, train=section(TrainConfig, recipe.get("train")), optim=section(OptimConfig, recipe.get("optim"))
    )


def check_schedule(point: ResumePoint, cfg: RunConfig) -> str | None:
    """The line the log gives a resume whose learning-rate schedule is not its checkpoint's (None when it
    is the same). The steps already trained must keep their rates: a longer stable phase or a cooldown
    branch does; a re-stretched cosine, another warmup, min_lr or lr does not, and is refused unless
    `optim.allow_schedule_change`."""
    recipe = point.state.get("recipe")
    if point.tag_dir is None or not isinstance(recipe, dict):
        return None
    old = _recorded_schedule(cfg, recipe)
    keys = [k for k in SCHEDULE_KEYS if getattr(old.optim, k) != getattr(cfg.optim, k)]
    changes = [f"train.max_steps {old.max_steps} -> {cfg.max_steps}"] if old.max_steps != cfg.max_steps else []
    changes += [f"optim.{k} {getattr(old.optim, k)} -> {getattr(cfg.optim, k)}" for k in keys]
    if not changes:
        return None
    step = point.step
    before, after = lr_at(old, step), lr_at(cfg, step)
    changed = next(
        (s for s in range(step) if not math.isclose(lr_at(old, s), lr_at(cfg, s), rel_tol=1e-12, abs_tol=0.0)), None
    )
    what = ", ".join(changes)
    rates = f"step {step + 1} at {after:.2e} (the checkpoint's schedule: {before:.2e})"
    if changed is None:
        return f"learning-rate schedule changed on resume ({what}): the {step} steps trained keep their rates; {rates}"
    if not cfg.optim.allow_schedule_change:
        restore = [f"optim.{k}={getattr(old.optim, k)}" for k in keys]  # the overrides that give the old schedule
        if old.max_steps != cfg.max_steps:
            t = old.train
            restore.insert(
                0, f"train.max_steps={t.max_steps}" if t.max_steps is not None else f"train.max_tokens={t.max_tokens}"
            )
        raise RecipeError(
            f"resuming {point.tag_dir} changes the learning-rate schedule ({what}): step {changed + 1}, trained at "
            f"{lr_at(old, changed):.2e}, would have had {lr_at(cfg, changed):.2e}, and {rates}. Fix: resume with the "
            f"checkpoint's schedule ({' '.join(restore)}), or add optim.allow_schedule_change=true to continue under "
            "the new one"
        )
    return f"learning-rate schedule changed on resume ({what}; optim.allow_schedule_change): {rates}"
