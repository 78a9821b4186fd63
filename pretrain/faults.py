"""Fault injection for the reliability tests (off unless `PRETRAIN_FAULTS` is set).

`PRETRAIN_FAULTS` holds a JSON object (parsed, never executed):

- `"nan_batches": [i, ...]`: the loss of global batch `i` (0-based position in the data order,
  i.e. `samples_seen // global batch`) is multiplied by NaN, so its gradients are NaN too; only
  the non-finite guard stands between that batch and the weights.
- `"nan_ranks": [r, ...]`: poison only on these ranks (default: all), to show that ranks agree.
- `"save_pause_s": s`, `"save_pause_steps": [n, ...]`: sleep `s` seconds inside the checkpoint
  save of step `n` (every save if no steps are given), after DeepSpeed has written its files and
  before the checkpoint is marked complete (a window to SIGKILL mid-save).

Everything else in the trainer runs as in production.
"""
from __future__ import annotations

import json
import os
import time
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

ENV = "PRETRAIN_FAULTS"


@lru_cache(maxsize=None)
def _parse(raw: str) -> dict[str, Any]:
    spec = json.loads(raw) if raw.strip() else {}
    if not isinstance(spec, dict):
        raise ValueError(f"{ENV} must hold a JSON object, got {raw!r}")
    return spec


def spec() -> dict[str, Any]:
    return _parse(os.environ.get(ENV, ""))


def poison_loss(loss: torch.Tensor, batch_index: int | None) -> torch.Tensor:
    s = spec()
    if not s or batch_index is None or batch_index not in s.get("nan_batches", ()):
        return loss
    ranks = s.get("nan_ranks")
    if ranks is not None:
        if (dist.get_rank() if dist.is_initialized() else 0) not in ranks:
            return loss
    return loss * float("nan")


def pause(point: str, step: int) -> None:
    s = spec()
    if point == "save" and s.get("save_pause_s") and step in s.get("save_pause_steps", [step]):
        time.sleep(float(s["save_pause_s"]))
