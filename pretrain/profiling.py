"""Profiling as recipe keys: a torch profiler trace of chosen optimizer steps, and a CUDA memory snapshot.

    profile:
      steps: [5, 7]         # optimizer steps 5 to 7 (1-based, inclusive)
      ranks: "0"            # "0" (rank 0) or "all" (one trace per rank)
      record_shapes: true   # input shapes of every op
      with_stack: false     # Python stacks (large traces)
      memory: true          # CUDA: torch.cuda.memory snapshot of those steps (pytorch.org/memory_viz)

The files it writes under RUN_DIR/profile/ and how to read them: docs/TRAINING.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

from .callbacks import Callback


@contextlib.contextmanager
def native_stderr_silenced():
    """The profiler's native library writes a status line to file descriptor 2 at every start and stop
    ("USDT: ... profiler_start"), whatever KINETO_LOG_LEVEL says: those calls run with it on /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class StepProfiler(Callback):
    """Starts the torch profiler before optimizer step `start` and writes its trace after step `end`
    (built only where `profile.steps` asks for a trace on this rank: `wanted`)."""

    def __init__(self, profile, run_dir: Path, rank: int, device: torch.device, message):
        self.cfg, self.rank, self.device, self.message = profile, rank, device, message
        self.out = Path(run_dir) / "profile"
        self.prof = None
        self.memory = False
        self.step_range = None  # the open "ProfilerStep#N" range: step boundaries in Perfetto and TensorBoard

    @staticmethod
    def wanted(profile, rank: int) -> bool:
        return bool(profile.steps) and (profile.ranks == "all" or rank == 0)

    def before_step(self, step: int) -> None:
        if self.prof is not None:
            self._open_step(step)
        if step != self.cfg.steps[0] or self.prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.cfg.memory:
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=200_000)
                self.memory = True
            else:
                self.message(
                    f"profile.memory: a memory snapshot is CUDA-only and this run is on {self.device.type}; "
                    "the trace is still written"
                )
        self.prof = torch.profiler.profile(
            activities=activities, record_shapes=self.cfg.record_shapes, with_stack=self.cfg.with_stack
        )
        with native_stderr_silenced():
            self.prof.__enter__()
        self._open_step(step)

    def _open_step(self, step: int) -> None:
        """Mark the step as the profiler's own scheduled steps are named, so viewers show its bounds."""
        self.step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.step_range.__enter__()

    def _close_step(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def after_update(self, step: int) -> None:
        """The step's range ends; the last profiled step writes the files."""
        self._close_step()
        if self.prof is not None and step >= self.cfg.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop and write what was recorded (also when the run ends inside the window)."""
        if self.prof is None:
            return
        self._close_step()
        with native_stderr_silenced():
            self.prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"rank{self.rank}.steps{self.cfg.steps[0]}-{self.cfg.steps[1]}"
        self.prof.export_chrome_trace(f"{stem}.pt.trace.json")
        self.prof = None
        if self.memory:
            torch.cuda.memory._dump_snapshot(f"{stem}.memory.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False
        self.message(f"profile: wrote {stem}.pt.trace.json")
