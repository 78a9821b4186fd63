"""Checkpoints written off the step's path (`checkpoint.background: true`; docs/TRAINING.md).

The step is blocked only while a save copies this rank's state into host memory. A writer thread
then runs the protocol of a synchronous save (pretrain/engine_checkpoint.py): write and fsync, the
ranks agree over a gloo process group of their own (so training's collectives go on beside it),
and rank 0 marks the tag COMPLETE and moves `latest`. At most one save is in flight: the next save,
a rollback and the end of the run wait for it, and a failed background write raises there, on every
rank at the same step. (DeepSpeed's decoupled checkpoint engine commits each rank's files on its
own, with no moment at which every rank's are known to be on disk, so it cannot move `latest`.)
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class SaveTiming:
    """One save: how long the step was blocked, and how long until the tag was marked complete."""

    step: int
    blocked_s: float
    complete_s: float | None = None  # None while a background write is in flight


class CheckpointWriter:
    """One background save at a time, its commit (write, fsync, agree, mark) on a thread of its own that
    lives as long as the run (a new thread per save would cost the step its start-up)."""

    def __init__(self, timeout_s: float):
        # Collective: every rank creates it at the same point (the loop's construction). Its collectives wait
        # for the slowest rank's writes, so they get checkpoint.timeout_s, not the step bound;
        # it crosses nodes on GLOO_SOCKET_IFNAME (pretrain.distributed.gloo_interface).
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # the host copies of the last save, reused by the next one (engine_checkpoint.copy_to_host):
        # safe because a save starts only after the one before it has been written
        self.staging: dict[str, Any] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        threading.Thread(target=self._work, name="checkpoint-writer", daemon=True).start()

    def _work(self) -> None:
        while True:
            commit, timing, started = self._jobs.get()
            try:
                commit()
                timing.complete_s = time.perf_counter() - started
            except BaseException as e:  # noqa: BLE001 - handed to the main thread at wait()
                self._error = e
            self._idle.set()

    def submit(self, commit: Callable[[], None], timing: SaveTiming, started: float) -> None:
        """Run `commit` in the background; `timing.complete_s` is set when it has finished."""
        if not self._idle.is_set():
            raise RuntimeError("a background save is still in flight; wait() for it first")
        self._idle.clear()
        self._jobs.put((commit, timing, started))

    def wait(self, raise_error: bool = True) -> None:
        """Block until the save in flight is on disk and marked (or abandoned); raise its failure."""
        self._idle.wait()
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error
