"""Progress that suits where it is written: a tqdm bar on a terminal, compact lines in a log.

Why: tqdm writing to a file (CI, Slurm, `> log`) ends every refresh with a newline, so one run
leaves hundreds of bar lines. Off a terminal, `progress_bar` returns a `LogProgress` that prints
one line when another 5% of the work is done (but not within 2 s of the last line) or 30 s have
passed since its last line, and one at the end, the way cluster users read logs:

    training: 45/120 step (38%), 1m52s elapsed, ~3m06s left | kv_retrieval/mixit

It lives at the bottom layer because every layer shows progress (prepare, the trainer, eval, studies).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, TextIO

from tqdm import tqdm

EVERY_S = 30.0  # a line at least this often while work advances, off a terminal
EVERY_FRACTION = 0.05  # and one per this share of the total,
MIN_S = 2.0  # but not more often than this: quick work prints its final line only


def is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def _count(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.1f}"


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class LogProgress:
    """The part of tqdm's interface this repository uses (update, n, set_postfix_str, refresh,
    write, close, iteration), printing a line per 5% of `total` (at most one per 2 s) or per 30 s."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        total: float | None = None,
        desc: str = "",
        unit: str = "it",
        file: TextIO | None = None,
        initial: float = 0,
    ):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit = total, desc, unit
        self.file = file if file is not None else sys.stderr
        self.n = self._start = initial
        self.postfix = ""
        self._t0 = self._last_t = time.monotonic()
        self._last_n = initial
        self._closed = False

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update(1)
        self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def update(self, n: float = 1) -> None:
        self.n += n
        self.refresh()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        """Print a line if enough work or time has passed since the last one."""
        now = time.monotonic()
        since = now - self._last_t
        step = EVERY_FRACTION * self.total if self.total else None
        if (step and self.n - self._last_n >= step and since >= MIN_S) or (since >= EVERY_S and self.n != self._last_n):
            self._print(now)

    def _print(self, now: float) -> None:
        elapsed = now - self._t0
        head = f"{self.desc}: " if self.desc else ""
        n = _count(self.n)
        if self.total:
            done = (self.n - self._start) / max(self.total - self._start, 1e-9)
            left = elapsed * (1 - done) / done if done > 0 else None
            text = (
                f"{head}{n}/{_count(self.total)} {self.unit} ({self.n / self.total:.0%}), {_duration(elapsed)} elapsed"
            )
            if left is not None and self.n < self.total:
                text += f", ~{_duration(left)} left"
        else:
            text = f"{head}{n} {self.unit}, {_duration(elapsed)} elapsed"
        print(text + (f" | {self.postfix}" if self.postfix else ""), file=self.file, flush=True)
        self._last_t, self._last_n = now, self.n

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        if not self._closed and self.n != self._last_n:
            self._print(time.monotonic())
        self._closed = True


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: float | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    file: TextIO | None = None,
    initial: float = 0,
    **tqdm_kwargs: Any,
):
    """A tqdm bar when `file` (default stderr) is a terminal, a LogProgress otherwise, a silent tqdm
    when not `enabled`. Extra keyword arguments go to tqdm only."""
    file = file if file is not None else sys.stderr
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if is_terminal(file):
        return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, initial=initial, **tqdm_kwargs)
    return LogProgress(iterable, total=total, desc=desc, unit=unit, file=file, initial=initial)
