"""Callbacks: what a run does around its steps besides the step itself, at named hook points of the loop,
so that the loop keeps the batch, the step and the schedule and a new feature does not grow it.

    before_step(step)   before optimizer step `step` (1-based) runs
    after_update(step)  after the update was applied, before its record is logged
    step_metrics(step)  what it adds to the step's record (the step then logs); asked every `metrics_every`
                        steps and at the last step (0: never)
    on_record(record)   each record the loop logs (rank 0; metrics.jsonl has it): the trackers
    after_log(step)     after its record is logged, before the loop's save decision
    save_due(step)      this rank's vote for a checkpoint after step `step`: the loop saves when any rank's
                        callback votes (agreed with the stop request in one all-reduce) and it is not the
                        last step (the loop's final save)
    on_save(step)       after every checkpoint the loop made (periodic, on a signal, the final one)
    on_nonfinite(step, position, loss, grad_norm)
                        step `step + 1`'s update was skipped (not finite): "rollback" has the loop reload
                        the last checkpoint; a callback may raise to stop the run
    on_exception(error) the loop is ending with `error` (before close): the trackers mark the run failed
    close()             once, when the loop ends (also inside a profiled window, or on an error)

pretrain/setup.py builds them: the NaN guard (pretrain/nan_guard.py, `train.nan_policy`), periodic saving
(pretrain/periodic_save.py, `checkpoint.every_steps` and `every_minutes`), the trackers on rank 0
(pretrain/trackers.py: TensorBoard, W&B, MLflow), the step profiler (pretrain/profiling.py) when
`profile.steps` asks for one on this rank, fault injection (pretrain/faults.py) only when PRETRAIN_FAULTS
asks for it, and validation (pretrain/validation.py) when `train.eval_every_steps` is set.
"""

from __future__ import annotations

from typing import Any


class Callback:
    """A no-op at every hook point; a callback overrides the points it uses (the loop calls only those)."""

    metrics_every = 0

    def before_step(self, step: int) -> None:
        pass

    def after_update(self, step: int) -> None:
        pass

    def step_metrics(self, step: int) -> dict[str, Any]:
        return {}

    def on_record(self, record: dict[str, Any]) -> None:
        pass

    def after_log(self, step: int) -> None:
        pass

    def save_due(self, step: int) -> bool:
        return False

    def on_save(self, step: int) -> None:
        pass

    def on_nonfinite(self, step: int, position: int | None, loss: float, grad_norm: float | None) -> str | None:
        return None

    def on_exception(self, error: BaseException) -> None:
        pass

    def close(self) -> None:
        pass
