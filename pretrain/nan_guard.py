"""`train.nan_policy` as a callback: what a run does after a step whose loss or gradient norm was not
finite (the engine's step gate, pretrain/engine.py, has already skipped its update on every rank).

`skip` drops the batch and logs it; `stop` raises `NonFiniteLoss` naming the step and the batch;
`rollback` has the loop reload the last complete checkpoint (the loop then steps over the offending
batch, a resumed run too: its position is in the checkpoint). More than `train.max_nan_skips` events
stop the run. Each event is a line of RUN_DIR/nonfinite.jsonl (rank 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from common.errors import NonFiniteLoss

from .callbacks import Callback


class NanGuard(Callback):
    """Applies `train.nan_policy`; built for every run (pretrain/setup.py)."""

    def __init__(
        self,
        policy: str,
        max_events: int,
        batch_sequences: int,
        run_dir: Path | None = None,
        message: Callable[[str], None] = print,
    ):
        self.policy, self.max_events, self.batch_sequences = policy, max_events, batch_sequences
        self.run_dir, self.message = run_dir, message  # run_dir: rank 0's, where nonfinite.jsonl is written
        self.events = 0

    def on_nonfinite(self, step: int, position: int | None, loss: float, grad_norm: float | None) -> str:
        """Optimizer step `step + 1` was not finite: 'skip' or 'rollback'; raises NonFiniteLoss for 'stop'
        or too many events."""
        if math.isfinite(loss):
            what = f"non-finite gradient norm ({grad_norm}; loss {loss:.4f} is finite)"
        else:
            what = f"non-finite loss ({loss})"
        self.events += 1
        where = f"optimizer step {step + 1}"
        if position is not None:
            where += f" (batch of global samples [{position}, {position + self.batch_sequences}) of the data order)"
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
        end = position + self.batch_sequences if position is not None else "?"
        self.message(
            f"{what} at step {step + 1}, global samples [{position}, {end}): "
            f"update skipped ({self.policy}; {self.events}/{self.max_events} allowed)"
        )
        if self.run_dir is not None:
            rec = {"step": step + 1, "samples": position, "loss": str(loss), "grad_norm": str(grad_norm)}
            with open(self.run_dir / "nonfinite.jsonl", "a") as f:
                f.write(json.dumps({**rec, "action": self.policy}) + "\n")
        return self.policy
