"""Preemption: SIGTERM/SIGINT ask the run to checkpoint and stop at the end of the current step.

The handler only records the request; the loop all-reduces it so every rank agrees before
anyone saves (a checkpoint is a collective).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class StopRequest:
    def __init__(self):
        self.requested = False
        self.signal = None

    def __call__(self, signum, frame):
        self.requested = True
        self.signal = signum


@contextlib.contextmanager
def stop_on_signals(enabled: bool) -> Iterator[StopRequest]:
    """Install the handlers for the block (when `enabled`; never outside the main thread)."""
    stop = StopRequest()
    old = {}
    if enabled:
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                old[s] = signal.signal(s, stop)
            except ValueError:  # not the main thread
                pass
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)
