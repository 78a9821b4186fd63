"""Periodic saving: `checkpoint.every_steps`, and `checkpoint.every_minutes` by rank 0's clock since the last
save ended (or the loop began), as a callback's vote; the loop agrees on the save with every rank and makes it."""

from __future__ import annotations

import time

from .callbacks import Callback


class PeriodicSave(Callback):
    def __init__(self, every_steps: int, every_minutes: float, rank: int):
        self.every_steps, self.every_s, self.rank = every_steps, every_minutes * 60, rank
        self.last_save = time.monotonic()  # built just before the loop: its start counts as a save

    def save_due(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        return self.rank == 0 and self.every_s > 0 and time.monotonic() - self.last_save >= self.every_s

    def on_save(self, step: int) -> None:
        self.last_save = time.monotonic()
