"""Non-finite losses and gradients never reach the weights.

A non-finite loss is detected after the forward and before the boundary `engine.step()`
(every rank agrees through an all-reduce), and `StepGate` then makes the wrapped inner
optimizer skip its update. A NaN can also appear in the gradients alone (a backward that
overflows while the loss is finite): on every layout the gate checks the norm of the
gradients it is about to apply (after DeepSpeed's reduction and clipping, over every rank)
and skips the update when it is not finite; where DeepSpeed's ZeRO optimizer finds the
overflow first and skips the step itself, it reports an infinite norm, which the trainer
treats the same way. So a NaN never reaches the weights or the Adam moments.
`train.nan_policy` decides what happens next (`NanGuard`): `skip` (drop the batch, log it),
`stop` (raise `NonFiniteLoss` naming the step and the batch), `rollback` (reload the last
complete checkpoint and step over the offending batch). More than `train.max_nan_skips`
events stop the run.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from common.errors import NonFiniteLoss


def describe_nonfinite(loss: float, grad_norm: float | None) -> str:
    """'non-finite loss (nan)' or, when the loss was finite, 'non-finite gradient norm (...)'."""
    if not math.isfinite(loss):
        return f"non-finite loss ({loss})"
    return f"non-finite gradient norm ({grad_norm}; loss {loss:.4f} is finite)"


class StepGate:
    """Wraps the innermost optimizer's `step` so that one optimizer step's update can be skipped.

    DeepSpeed calls the inner (torch) optimizer on every rank after gradient reduction and
    clipping (once per optimizer step, or once per parameter sub-group under ZeRO-3); skipping
    it leaves the fp32 master weights, the moments and the Adam step count untouched (ZeRO
    copies the unchanged master weights back to the model). `begin(skip)` opens an optimizer
    step; at its first inner call the gate decides for the whole step: skip when asked to
    (a non-finite loss) or when the norm of the gradients it holds, over every rank, is not
    finite (under ZeRO-3 that is the first sub-group's; ZeRO-3 checks the global norm itself
    before any inner call). `end()` says whether the update was skipped."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.skip = False
        self.decided = False
        self._step = optimizer.step
        optimizer.step = self.step

    def _grad_norm_finite(self) -> bool:
        """Is the norm of the gradients this optimizer holds, summed over every rank, finite?
        (A NaN or inf anywhere makes it so; one all-reduce and one host sync.)"""
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        dev = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        sq = torch.zeros((), device=dev, dtype=torch.float32)
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            sq = norms.pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(sq)
        return bool(torch.isfinite(sq).item())

    def begin(self, skip: bool = False) -> None:
        self.skip, self.decided = skip, False

    def end(self) -> bool:
        """True when the optimizer step since `begin` skipped its update."""
        skipped = self.skip and self.decided
        self.skip, self.decided = False, False
        return skipped

    def step(self, *args, **kwargs):
        if not self.decided:
            self.skip = self.skip or not self._grad_norm_finite()
            self.decided = True
        if self.skip:
            return None
        return self._step(*args, **kwargs)


def install_step_gate(engine) -> StepGate:
    """Gate the innermost optimizer of a DeepSpeed engine."""
    opt = engine.optimizer
    return StepGate(getattr(opt, "optimizer", opt))


def any_rank(flag: bool | torch.Tensor, device: torch.device, group=None) -> bool:
    """True on every rank when `flag` (a bool, or a one-element tensor on the device) is true on any rank."""
    if isinstance(flag, torch.Tensor):
        t = flag.detach().reshape(1).to(device=device, dtype=torch.float32)
    else:
        t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


class NanGuard:
    """Applies `train.nan_policy` to a step whose loss or gradient norm was not finite (its update was skipped)."""

    def __init__(self, policy: str, max_events: int, skipped: list[int] | None = None):
        self.policy, self.max_events = policy, max_events
        self.skip_positions: set[int] = set(int(p) for p in (skipped or []))
        self.events = 0

    def on_nonfinite(self, step: int, position: int | None, batch_size: int, what: str) -> str:
        """`what` says what was not finite (e.g. 'non-finite loss (nan)'). Returns 'skip' or
        'rollback'; raises NonFiniteLoss for 'stop' or too many events."""
        self.events += 1
        where = (
            f"optimizer step {step + 1} (batch of global samples [{position}, {position + batch_size}) "
            f"of the data order)"
            if position is not None
            else f"optimizer step {step + 1}"
        )
        if self.policy == "stop":
            raise NonFiniteLoss(
                f"{what} at {where}; the update was not applied and nothing was saved after it. "
                "Fix: lower optim.lr or raise optim.warmup_steps, check the data at that position, or set "
                "train.nan_policy=skip|rollback to step over such batches; then --resume auto"
            )
        if self.events > self.max_events:
            raise NonFiniteLoss(
                f"{what} at {where}: {self.events} non-finite steps in this process, more than "
                f"train.max_nan_skips={self.max_events}; stopping (the model diverges or the data is broken). "
                "Fix: lower optim.lr, check the data, or resume from an earlier checkpoint with --resume PATH"
            )
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
