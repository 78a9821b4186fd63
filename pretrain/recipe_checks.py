"""Checks of recipe values that need more than a dataclass: declared types, the run name,
and the task schema (`task: lm | classification` and its `classification:` section).

The classification schema lives here, not with the classification trainer, so loading a
recipe never imports the trainer.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any

from common.errors import RecipeError, did_you_mean
from model.config import DEFAULT_POOLING, POOLINGS

NanPolicy = typing.Literal["skip", "stop", "rollback"]
TASKS = ("lm", "classification")
CLASSIFICATION_DEFAULTS: dict[str, Any] = {"num_labels": None, "pooling": DEFAULT_POOLING, "init_from": None}


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and (not args or all(_type_ok(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def check_value(key: str, v: Any, tp: Any, default: Any = dataclasses.MISSING) -> None:
    """`v` has the declared type `tp` (ints for floats are fine), else one error naming `key`."""
    if typing.get_origin(tp) is typing.Literal and not _type_ok(v, tp):
        choices = list(typing.get_args(tp))
        fix = did_you_mean(str(v), [str(c) for c in choices]).strip() or "use one of them"
        raise RecipeError(f"{key} must be one of {choices}, got {v!r}. Fix: {fix}")
    if not _type_ok(v, tp):
        want = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
        example = "null" if default is None else repr(default)  # YAML reads None as a string
        fix = f". Fix: e.g. {key}={example}" if default is not dataclasses.MISSING else ""
        raise RecipeError(f"{key}={v!r} has type {type(v).__name__}; expected {want}{fix}")


def check_types(section: str, obj: Any) -> None:
    """Every field of a recipe dataclass holds a value of its declared type."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        check_value(f"{section}.{f.name}", getattr(obj, f.name), hints.get(f.name, Any), f.default)


def check_name(name: Any) -> None:
    """`name` picks runs/<name>: one plain path component, so nothing is written outside runs/."""
    plain = isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
    if not plain or os.path.isabs(name):
        raise RecipeError(
            f"name={name!r} must be a single directory name (no '/', '..' or absolute path): it "
            "becomes runs/<name>. Fix: name: my_run, or give --run-dir DIR"
        )


def classification_settings(cfg) -> dict[str, Any]:
    """The recipe's `classification:` section with defaults filled in."""
    return {**CLASSIFICATION_DEFAULTS, **(cfg.classification or {})}


def check_task(cfg) -> None:
    """Recipe checks for `task` / `classification` (called from RunConfig.validate)."""
    if cfg.task not in TASKS:
        raise RecipeError(f"task must be one of {list(TASKS)}, got {cfg.task!r}")
    source = cfg.data.source if cfg.data is not None else ""
    if cfg.task == "lm":
        if cfg.classification:
            raise RecipeError(
                "classification: given but task is 'lm'. Fix: set task: classification, or drop the section"
            )
        if source.startswith("classify:"):
            raise RecipeError(
                f"data.source={source!r} is classification data but task is 'lm'. Fix: task: classification"
            )
        return
    unknown = set(cfg.classification or {}) - set(CLASSIFICATION_DEFAULTS)
    if unknown:
        raise RecipeError(f"classification: unknown keys {sorted(unknown)}; valid: {sorted(CLASSIFICATION_DEFAULTS)}")
    s = classification_settings(cfg)
    if s["pooling"] not in POOLINGS:
        raise RecipeError(f"classification.pooling must be one of {list(POOLINGS)}, got {s['pooling']!r}")
    n = s["num_labels"]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
        raise RecipeError(f"classification.num_labels must be an integer >= 2 (or null: from the data), got {n!r}")
    if not source.startswith("classify:"):
        raise RecipeError(
            f"task: classification needs data.source='classify:<file.jsonl|file.csv|hf:NAME>', got {source!r}"
        )
    if cfg.parallel.pipeline_stages > 1:
        raise RecipeError(
            "task: classification does not support pipeline parallelism (parallel.pipeline_stages="
            f"{cfg.parallel.pipeline_stages}). Fix: parallel.pipeline_stages=1 with ZeRO (zero1..zero3)"
        )


def check_profile(profile) -> None:
    steps = profile.steps
    if steps and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        raise RecipeError(f"profile.steps must be [start, end] with 1 <= start <= end, got {steps}. Fix: e.g. [5, 7]")
    if profile.ranks not in ("0", "all"):
        raise RecipeError(f'profile.ranks must be "0" or "all", got {profile.ranks!r}')
