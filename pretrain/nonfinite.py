"""Non-finite losses never reach the weights.

A non-finite loss is detected after the forward and before the boundary `engine.step()`
(every rank agrees through an all-reduce), and `StepGate` then makes the wrapped inner
optimizer skip its update, so a NaN never reaches the weights or the Adam moments.
`train.nan_policy` decides what happens next (`NanGuard`): `skip` (drop the batch, log it),
`stop` (raise `NonFiniteLoss` naming the step and the batch), `rollback` (reload the last
complete checkpoint and step over the offending batch). More than `train.max_nan_skips`
events stop the run.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .errors import NonFiniteLoss


class StepGate:
    """Wraps the innermost optimizer's `step` so that one update can be skipped.

    DeepSpeed calls the inner (torch) optimizer once per optimizer step on every rank, after
    gradient reduction and clipping; skipping it leaves the fp32 master weights, the moments and
    the Adam step count untouched (ZeRO copies the unchanged master weights back to the model).
    With `check_grads` (pipeline parallelism, where the loss is known only after the step), the
    gate itself decides: any non-finite gradient on any rank skips the update."""

    def __init__(self, optimizer, check_grads: bool = False):
        self.optimizer = optimizer
        self.skip_next = False
        self.check_grads = check_grads
        self.skipped = 0
        self._step = optimizer.step
        optimizer.step = self.step

    def _grads_finite(self) -> bool:
        bad = torch.zeros(1)
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    bad.fill_(1.0)
        dev = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        bad = bad.to(dev)
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def step(self, *args, **kwargs):
        skip = self.skip_next or (self.check_grads and not self._grads_finite())
        self.skip_next = False
        if skip:
            self.skipped += 1
            return None
        return self._step(*args, **kwargs)


def install_step_gate(engine, check_grads: bool) -> StepGate:
    """Gate the innermost optimizer of a DeepSpeed engine."""
    opt = engine.optimizer
    return StepGate(getattr(opt, "optimizer", opt), check_grads=check_grads)


def any_rank(flag: bool, device: torch.device, group=None) -> bool:
    """True on every rank when `flag` is true on any rank."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def is_finite(x: torch.Tensor | float) -> bool:
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x.detach()).all())
    return math.isfinite(x)


class NanGuard:
    """Applies `train.nan_policy` to a step whose loss was not finite (its update was skipped)."""

    def __init__(self, policy: str, max_events: int, skipped: list[int] | None = None):
        self.policy, self.max_events = policy, max_events
        self.skip_positions: set[int] = set(int(p) for p in (skipped or []))
        self.events = 0

    def on_nonfinite(self, step: int, position: int | None, batch_size: int, loss: float) -> str:
        """Returns 'skip' or 'rollback'; raises NonFiniteLoss for 'stop' or too many events."""
        self.events += 1
        where = (f"optimizer step {step + 1} (batch of global samples [{position}, {position + batch_size}) "
                 f"of the data order)" if position is not None else f"optimizer step {step + 1}")
        if self.policy == "stop":
            raise NonFiniteLoss(
                f"non-finite loss ({loss}) at {where}; the update was not applied and nothing was saved after it. "
                "Fix: lower optim.lr or raise optim.warmup_steps, check the data at that position, or set "
                "train.nan_policy=skip|rollback to step over such batches; then --resume auto")
        if self.events > self.max_events:
            raise NonFiniteLoss(
                f"non-finite loss ({loss}) at {where}: {self.events} non-finite steps in this process, more than "
                f"train.max_nan_skips={self.max_events}; stopping (the model diverges or the data is broken). "
                "Fix: lower optim.lr, check the data, or resume from an earlier checkpoint with --resume PATH")
        if position is not None:
            self.skip_positions.add(int(position))
        return self.policy


def loader_position(loader) -> int | None:
    """Global index of the first sample of the loader's next batch (None if it does not say)."""
    try:
        return int(loader.state_dict()["samples_seen"])
    except Exception:  # noqa: BLE001 - a loader without a position still trains; skips are then by step
        return None


def skip_marked_batches(loader, guard: NanGuard) -> int:
    """Advance the loader past batches that a rollback marked as offending; returns how many."""
    n = 0
    while guard.skip_positions:
        pos = loader_position(loader)
        if pos is None or pos not in guard.skip_positions:
            break
        next(loader)
        n += 1
    return n
