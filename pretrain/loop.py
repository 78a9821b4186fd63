"""The training loop: steps, logging (with what the callbacks add to a step's record: validation,
pretrain/validation.py), checkpoints (when a callback votes for one: pretrain/periodic_save.py), preemption,
and the non-finite policy.

A step whose loss or gradient norm was not finite has had its update skipped by the engine's step
gate (pretrain/engine.py); the callbacks' `on_nonfinite` decide what happens next (the NaN guard,
pretrain/nan_guard.py, applies `train.nan_policy`): a rollback reloads the last complete checkpoint,
and the loop steps over every batch that was not finite from then on (a resumed run too: their positions
are in the checkpoint).

Whether to save is decided collectively after every step (one all-reduce of the stop request and of
the callbacks' votes, which read rank 0's `checkpoint.every_minutes` clock), so every rank enters the
collective save at the same step.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.errors import RunStopped, UserError
from model.mfu import mfu

from .bounds import CollectiveBounds
from .callbacks import Callback
from .checkpoint_writer import SaveTiming
from .config import RunConfig
from .context import RunContext
from .engine import ModelEngine
from .engine_checkpoint import Checkpointer
from .metrics import Logger, memory_gib, train_flops_per_token
from .preemption import StopRequest
from .run_dir import restart_count


def loader_position(loader) -> int | None:
    """Global index of the first sample of the loader's next batch (None if it does not say)."""
    try:
        return int(loader.state_dict()["samples_seen"])
    except Exception:  # noqa: BLE001 - a loader without a position still trains; skips are then by step
        return None


def lr_at(cfg: RunConfig, step: int, max_steps: int | None = None) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine, linear or no decay
    to min_lr, or `wsd`: the peak rate until `optim.decay_start` (default: the last `decay_fraction` of
    max_steps), then 1-sqrt to min_lr at the last step (cooldown branches, docs/SCALING.md).
    `max_steps`: the run's, when the caller holds it (default: computed from cfg)."""
    o = cfg.optim
    max_steps = cfg.max_steps if max_steps is None else max_steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.decay == "constant":
        return o.lr
    if o.decay == "wsd":
        start = o.decay_start
        if start is None:
            start = max(o.warmup_steps, max_steps - round(o.decay_fraction * max_steps))
        if step < start:
            return o.lr
        progress = min(1.0, (step - start + 1) / max(1, max_steps - start))
        return o.min_lr + (o.lr - o.min_lr) * (1.0 - math.sqrt(progress))
    span = o.decay_steps if o.decay_steps is not None else max(1, max_steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / max(1, span))
    if o.decay == "linear":
        return o.lr - (o.lr - o.min_lr) * progress
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class RunResult:
    run_dir: Path
    losses: dict[int, float] = field(default_factory=dict)  # step (1-based, after the update) -> loss
    val_losses: dict[int, float] = field(default_factory=dict)
    final_step: int = 0
    tokens_seen: int = 0
    last_checkpoint: Path | None = None
    resumed_from: Path | None = None
    interrupted: bool = False
    saves: list[SaveTiming] = field(default_factory=list)  # each save's blocked and until-complete seconds


class TrainingLoop:
    """One run's loop over optimizer steps from the resume point's step to `cfg.max_steps`, over the
    components the run built (pretrain/train.py); a checkpoint records the state of each that has some."""

    def __init__(
        self,
        ctx: RunContext,
        model_engine: ModelEngine,
        loader,
        logger: Logger,
        checkpointer: Checkpointer,
        callbacks: list[Callback] | None = None,
        bounds: CollectiveBounds | None = None,
    ):
        cfg, state = ctx.cfg, ctx.point.state
        self.ctx, self.cfg, self.mcfg, self.model_engine = ctx, cfg, ctx.mcfg, model_engine
        self.loader, self.logger, self.checkpointer, self.run_dir = loader, logger, checkpointer, ctx.run_dir
        self.device, self.rank, self.world = ctx.device, ctx.rank, ctx.world
        self.tokenizer_id = getattr(loader, "tokenizer_id", None)
        # the run's derived sizes, read once: the step path does not re-derive them from the recipe
        self.max_steps, self.tokens_per_step, self.batch_sequences = (
            cfg.max_steps,
            cfg.tokens_per_step,
            cfg.global_batch_size,
        )
        self.start_step = self.step = int(state.get("step", 0))
        self.tokens_seen = int(state.get("tokens_seen", self.start_step * self.tokens_per_step))
        self.result = RunResult(
            run_dir=ctx.run_dir, resumed_from=ctx.point.tag_dir, final_step=self.start_step, saves=checkpointer.saves
        )
        self._fpt: dict[tuple, float] = {}  # FLOPs per token per stretch of the freeze schedule (model/flops.py)
        self._bounds = sorted(ctx.mcfg.schedule_boundaries())
        self.callbacks = list(callbacks or [])  # pretrain/callbacks.py: what pretrain/setup.py built
        hooks = ("before_step", "after_update", "on_record", "after_log", "save_due", "on_save")
        self._before_step, self._after_update, self._on_record, self._after_log, self._save_due, self._on_save = (
            [getattr(cb, hook) for cb in self.callbacks if getattr(type(cb), hook) is not getattr(Callback, hook)]
            for hook in hooks
        )
        self.skip_positions: set[int] = set(int(p) for p in state.get("nan_skipped", []))
        self.restarts = restart_count(ctx.run_dir)  # launch.sh --max-restarts records each one
        self.bounds = bounds  # the step bound, derived from the first steps' time unless the recipe sets it
        self._step_s = 0.0  # this step's time, while the bounds time the first steps

    # -- what a checkpoint records besides the engine's tensors (trainer_state.json) ----------
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "loader": self.loader.state_dict(),
            "tokenizer_id": self.tokenizer_id,
            **self.model_engine.checkpoint_state(),
            "nan_skipped": sorted(self.skip_positions),  # the batches stepped over, so a resumed run does too
            "recipe": self.ctx.resolved,
            "universal": False,
            "time": time.time(),
        }

    def save(self) -> Path:
        """Collective (pretrain/engine_checkpoint.py's Checkpointer)."""
        path = self.checkpointer.save(self.model_engine, self.step, self.checkpoint_state())
        for on_save in self._on_save:
            on_save(self.step)
        return path

    def rollback(self) -> None:
        """Reload the last intact checkpoint (weights, optimizer, data position)."""
        tag_dir, st = self.checkpointer.rollback(self.model_engine, self.cfg.seed, self.step, self.logger.message)
        self.loader.load_state_dict(st["loader"])
        self.step, self.tokens_seen = int(st["step"]), int(st["tokens_seen"])
        self.logger.truncate_after(self.step)
        self.logger.message(f"rolled back to {tag_dir} (step {self.step}); skipping the offending batch")

    # -- one step -----------------------------------------------------------------------------
    def _changes_trainable_set(self, step: int) -> bool:
        """The freeze schedule's trainable set at `step` is not the engine's."""
        return self.mcfg.frozen_groups_at(step) != self.mcfg.frozen_groups_at(self.model_engine.trainable_step)

    def _log(self, loss: float, lr: float, grad_norm: float | None, dt: float) -> None:
        cfg, step = self.cfg, self.step
        rec: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "tokens_seen": self.tokens_seen}
        if self.restarts:
            rec["restarts"] = self.restarts
        added: dict[str, Any] = {}
        for cb in self.callbacks:
            if cb.metrics_every and (step % cb.metrics_every == 0 or step == self.max_steps):
                added.update(cb.step_metrics(step))
        rec.update(added)
        if "val_loss" in added:
            self.result.val_losses[step] = added["val_loss"]
        if step % cfg.logging.every_steps == 0 or step == self.max_steps or added:
            fpt = self._flops_per_token(step - 1)
            tps = self.tokens_per_step / dt
            rec.update(grad_norm=grad_norm, tokens_per_s=tps, step_time_s=dt, tflops=tps * fpt / self.world / 1e12)
            peak, source = self.logger.peak
            if peak:
                rec.update(mfu=mfu(rec["tflops"], peak), mfu_peak=source)
                if self.mcfg.causal:  # attention's causal half only: the work a kernel that skips the rest does
                    fpt_causal = self._flops_per_token(step - 1, causal_half=True)
                    rec["mfu_causal"] = mfu(tps * fpt_causal / self.world / 1e12, peak)
            rec.update(memory_gib(self.device))
            self.logger.log(rec)
            for on_record in self._on_record:
                on_record(rec)

    def _flops_per_token(self, step: int, causal_half: bool = False) -> float:
        """Training FLOPs per token of the trainable set at `step`, counted once per stretch between the
        freeze schedule's boundaries (the trainable set is constant within one)."""
        key = (bisect.bisect_right(self._bounds, step), causal_half)
        if key not in self._fpt:
            self._fpt[key] = train_flops_per_token(self.mcfg, self.cfg.train.seq_len, step, causal_half)[0]
        return self._fpt[key]

    def _agree(self, stop: StopRequest, flags: torch.Tensor) -> tuple[bool, bool]:
        """Collective: (a signal asked some rank to stop, some rank's callbacks vote for a save); the same
        all-reduce agrees on the median step time the step bound is derived from, at the step it is known."""
        votes = [due(self.step) for due in self._save_due]  # every callback asked: votes have no side effects
        timing = self.bounds is not None and self.bounds.timing  # once derived, the step path leaves it alone
        flags[0], flags[1] = float(stop.requested), float(any(votes))
        flags[2] = self.bounds.step_time(self._step_s) if timing else 0.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop_now, save_due, median = flags.tolist()  # one host sync
        if median > 0:
            self.bounds.derive(median)
        return bool(stop_now), bool(save_due)

    def run(self, stop: StopRequest, stop_after_steps: int | None = None) -> RunResult:
        try:
            self._steps(stop, stop_after_steps)
        except BaseException as e:
            for cb in self.callbacks:
                cb.on_exception(e)
            if isinstance(e, (UserError, RunStopped)):  # every rank stops at this step: their writers finish together
                self.checkpointer.wait(raise_error=False)
            raise
        finally:
            for cb in self.callbacks:
                cb.close()
        self.checkpointer.wait()  # the last checkpoint is complete (or its failure raised) before the run returns
        return self.result

    def _steps(self, stop: StopRequest, stop_after_steps: int | None) -> None:
        cfg, model_engine, result = self.cfg, self.model_engine, self.result
        flags = torch.zeros(3, device=self.device)
        while self.step < self.max_steps:
            if self._changes_trainable_set(self.step):
                self.logger.message(
                    f"after step {self.step}: the freeze schedule changes the trainable set to "
                    f"frozen={sorted(self.mcfg.frozen_groups_at(self.step))}; rebuilding the engine"
                )
                model_engine.rebuild(self.step)
            for before_step in self._before_step:
                before_step(self.step + 1)
            t0 = time.perf_counter()
            while self.skip_positions and loader_position(self.loader) in self.skip_positions:
                next(self.loader)
            position = loader_position(self.loader)
            batch = next(self.loader)
            lr = lr_at(cfg, self.step, self.max_steps)
            model_engine.set_lr(lr)
            res = model_engine.train_step(batch, None if position is None else position // self.batch_sequences)
            loss, grad_norm = res.loss, res.grad_norm
            if not res.finite:  # the update was skipped on every rank; a callback may stop the run (raises)
                actions = [cb.on_nonfinite(self.step, position, loss, grad_norm) for cb in self.callbacks]
                if position is not None:
                    self.skip_positions.add(int(position))
                if "rollback" in actions:
                    self.rollback()
                continue
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = self._step_s = time.perf_counter() - t0
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            result.losses[self.step] = loss
            for after_update in self._after_update:
                after_update(self.step)
            self._log(loss, lr, grad_norm, dt)
            for after_log in self._after_log:
                after_log(self.step)
            # Preemption and periodic saves: every rank must agree before anyone saves.
            stop_now, save_due = self._agree(stop, flags)
            if stop_now:
                self.logger.message(f"signal received: saving a checkpoint at step {self.step} and stopping")
                result.last_checkpoint = self.save()
                result.interrupted = True
                break
            if save_due and self.step < self.max_steps:
                result.last_checkpoint = self.save()
            if stop_after_steps is not None and self.step >= stop_after_steps:
                break
        else:
            if cfg.checkpoint.save_final and self.step > self.start_step:
                result.last_checkpoint = self.save()
            elif result.resumed_from is not None and self.step == self.start_step:
                result.last_checkpoint = result.resumed_from
        result.final_step = self.step
        result.tokens_seen = self.tokens_seen
