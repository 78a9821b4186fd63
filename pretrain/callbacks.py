"""Callbacks: what a run does around its steps besides the step itself, at named hook points of the loop,
so that the loop keeps the batch, the step and the schedule and a new feature does not grow it.

    before_step(step)   before optimizer step `step` (1-based) runs
    after_update(step)  after the update was applied, before its record is logged
    after_log(step)     after its record is logged, before the loop's save decision
    close()             once, when the loop ends (also inside a profiled window, or on an error)

pretrain/setup.py builds them: the step profiler (pretrain/profiling.py) when `profile.steps` asks for
one on this rank, and fault injection (pretrain/faults.py) only when PRETRAIN_FAULTS asks for it.
"""

from __future__ import annotations


class Callback:
    """A no-op at every hook point; a callback overrides the points it uses."""

    def before_step(self, step: int) -> None:
        pass

    def after_update(self, step: int) -> None:
        pass

    def after_log(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
