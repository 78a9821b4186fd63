"""Fault injection for the reliability tests (off unless `PRETRAIN_FAULTS` is set).

`PRETRAIN_FAULTS` holds a JSON object (parsed, never executed):

- `"nan_batches": [i, ...]`: the loss of global batch `i` (0-based position in the data order,
  i.e. `samples_seen // global batch`) is multiplied by NaN, so its gradients are NaN too; only
  the non-finite guard stands between that batch and the weights.
- `"nan_grad_batches": [i, ...]`: the loss of global batch `i` stays finite but its backward
  is NaN (as when a backward overflows), so only the gradients are NaN; only the gradient-norm
  check stands between that batch and the weights. Not under pipeline parallelism (there the
  loss exists only on the last stage; its guard checks the gradients anyway).
- `"nan_ranks": [r, ...]`: poison only on these ranks (default: all), to show that ranks agree.
- `"kill_steps": [n, ...]`, `"kill_rank": r`: rank r (default 0) kills itself with SIGKILL right after
  optimizer step n, once per step and run dir (a marker file remembers it, so the restarted run
  passes step n): what a crashed or OOM-killed rank looks like to the launcher.
- `"save_pause_s": s`, `"save_pause_steps": [n, ...]`, `"save_pause_ranks": [r, ...]`: sleep `s` seconds
  inside the checkpoint save of step `n` (every save if no steps are given) on ranks r (default: all),
  after DeepSpeed has written its files and before the checkpoint is marked complete (a window to
  SIGKILL mid-save; on some ranks only, a slow writer the others wait for).
- `"comm_error_steps": [n, ...]`, `"comm_error_rank": r`: after optimizer step n (once per step and run
  dir), rank r (default 0) reports a failed collective through the probe `comm_probe()` returns and its
  main thread blocks for good: what a rank looks like under NCCL when the watchdog has recorded a dead
  peer while the Python call sits in a CUDA sync (pretrain.distributed.watch_collectives must end it).

Everything else in the trainer runs as in production; without the variable no step calls into this module.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from .callbacks import Callback

ENV = "PRETRAIN_FAULTS"


@lru_cache(maxsize=None)
def _parse(raw: str) -> dict[str, Any]:
    spec = json.loads(raw) if raw.strip() else {}
    if not isinstance(spec, dict):
        raise ValueError(f"{ENV} must hold a JSON object, got {raw!r}")
    return spec


def spec() -> dict[str, Any]:
    return _parse(os.environ.get(ENV, ""))


class _NanBackward(torch.autograd.Function):
    """The identity forward, a NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def loss_poisoner() -> Callable[[torch.Tensor, int | None], torch.Tensor] | None:
    """`poison_loss` when the fault spec asks to poison some batch, else None: the engine reads this once,
    so a production step never enters fault-injection code."""
    s = spec()
    return poison_loss if s.get("nan_batches") or s.get("nan_grad_batches") else None


def poison_loss(loss: torch.Tensor, batch_index: int | None) -> torch.Tensor:
    """The loss of batch `batch_index` as the fault spec wants it: NaN (`nan_batches`), finite with
    a NaN backward (`nan_grad_batches`), or unchanged."""
    s = spec()
    if not s or batch_index is None:
        return loss
    ranks = s.get("nan_ranks")
    if ranks is not None and (dist.get_rank() if dist.is_initialized() else 0) not in ranks:
        return loss
    if batch_index in s.get("nan_batches", ()):
        return loss * float("nan")
    if batch_index in s.get("nan_grad_batches", ()):
        if not loss.requires_grad:
            raise ValueError(f"{ENV}: nan_grad_batches needs the loss itself (not under pipeline parallelism)")
        return _NanBackward.apply(loss)
    return loss


def step_killer(run_dir: Path, rank: int) -> list[Callback]:
    """[callbacks that kill this process, or fail its collectives, after the steps the fault spec lists]
    when it lists such steps, else [] (read once, when the run is built)."""
    s = spec()
    kinds = (("kill_steps", StepKiller), ("comm_error_steps", CommFailure))
    return [cls(Path(run_dir), rank) for key, cls in kinds if s.get(key)]


_INJECTED: list[str] = []  # the failed collective CommFailure reports


def comm_probe() -> Callable[[], str | None] | None:
    """The probe pretrain.distributed.watch_collectives polls on a CPU run that injects comm_error_steps,
    else None (production: the NCCL backend's own record, distributed.comm_failure)."""
    return (lambda: _INJECTED[0] if _INJECTED else None) if spec().get("comm_error_steps") else None


class CommFailure(Callback):
    """After a listed step: report a failed collective and block the main thread, once per step and run dir."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank = run_dir, rank

    def after_log(self, step: int) -> None:
        s = spec()
        marker = self.run_dir / f".fault_comm_error_step{step}"
        if step not in s["comm_error_steps"] or self.rank != s.get("comm_error_rank", 0) or marker.exists():
            return
        marker.touch()
        _INJECTED.append(f"NCCL COMM_ERROR injected after step {step}")
        threading.Event().wait()  # as a CUDA sync on a collective whose peer is gone


class StepKiller(Callback):
    """SIGKILL after a listed step's record is logged, once per step (a marker file in the run dir)."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank = run_dir, rank

    def after_log(self, step: int) -> None:
        s = spec()
        if step not in s["kill_steps"] or self.rank != s.get("kill_rank", 0):
            return
        marker = self.run_dir / f".fault_killed_step{step}"
        if marker.exists():
            return
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def pause(point: str, step: int) -> None:
    s = spec()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if point == "save" and s.get("save_pause_s") and step in s.get("save_pause_steps", [step]):
        if rank in s.get("save_pause_ranks", [rank]):
            time.sleep(float(s["save_pause_s"]))
