"""How long a collective waits for the slowest rank before this rank stops with the project's message: the
rendezvous bound while the ranks meet (pretrain/rendezvous.py), the start-up bound while the run is built, and
the step bound. The step bound is `parallel.timeout_s` where the recipe sets one; else it is derived from the
measured step time, since ranks in lockstep wait for each other a fraction of a step: 20 times the median step,
at least `parallel.min_timeout_s`, ends a frozen peer in minutes where a fixed default waited 30 (saves wait
`checkpoint.timeout_s`: pretrain/engine_checkpoint.py)."""

from __future__ import annotations

import statistics

from .config import ParallelConfig
from .distributed import set_default_timeout, set_group_timeouts

STEP_MULTIPLE = 20
TIMED_STEPS = 5  # steps timed after the first of each start (which warms up) before the bound is derived


class CollectiveBounds:
    """The bounds of one run; `now_s` is the one in force for every process group but `exempt`."""

    def __init__(self, p: ParallelConfig):
        self.rendezvous_s, self.min_s = p.rendezvous_timeout_s, p.min_timeout_s
        self.timing = p.timeout_s is None  # steps are timed until the bound is derived (read on the step path)
        self.now_s = p.startup_timeout_s if self.timing else p.timeout_s
        self.source = "the start-up bound parallel.startup_timeout_s" if self.timing else "parallel.timeout_s"
        self.exempt: list = []  # groups with a bound of their own: the background checkpoint writer's
        self.times: list[float] = []
        self.derived = False

    def describe(self) -> str:
        """The bound in force, as a message names it."""
        if self.derived:
            return (
                f"the step bound of {self.now_s:g}s ({STEP_MULTIPLE}x the median step of {self.median_s:.3g}s, at "
                f"least parallel.min_timeout_s={self.min_s:g}s; parallel.timeout_s sets one)"
            )
        return f"{self.source}={self.now_s:g}s"

    def step_time(self, seconds: float) -> float:
        """Record a step's time; returns this rank's median step once enough are timed (the step at which every
        rank proposes it: their largest is agreed, then `derive`), else 0."""
        if not self.timing:
            return 0.0
        self.times.append(seconds)
        return statistics.median(self.times[1:]) if len(self.times) == TIMED_STEPS + 1 else 0.0

    def derive(self, median_s: float) -> None:
        """The step bound from the median step every rank agreed on, set on every process group."""
        if median_s <= 0 or self.derived:
            return
        self.median_s, self.derived, self.timing = median_s, True, False
        self.now_s = max(self.min_s, STEP_MULTIPLE * median_s)
        set_group_timeouts(self.now_s, self.exempt)
        set_default_timeout(self.now_s)  # groups made later (an engine rebuilt by the freeze schedule)
