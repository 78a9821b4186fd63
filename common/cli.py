"""One line for bad input: every command-line tool prints `error: ... Fix: ...` and exits non-zero,
never a traceback.

`CliParser` is an ArgumentParser whose usage errors (a missing or misspelt option, a bad value) are
that one line; `run_cli(body)` runs a CLI's body and turns the project's two error kinds into that line:
a `UserError` or an `OSError` (a path that is missing, unreadable or on a full disk) exits 2, a
`RunStopped` exits 3.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

from .errors import RunStopped, UserError

DEFAULT_FIX = "check the paths and values named above (--help lists the options)"
BAD_INPUT, STOPPED = 2, 3  # exit codes


def print_error(e: BaseException | str, fix: str | None = None) -> None:
    """Print `error: MESSAGE. Fix: ...` on one line; the message's own `Fix:` is kept, else `fix` is added."""
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in msg:
        msg += f": {e.filename}"
    if "Fix:" not in msg:
        msg = f"{msg.rstrip('. ')}. Fix: {fix or DEFAULT_FIX}"
    print(f"error: {msg}", file=sys.stderr, flush=True)


def ints(text: str) -> list[int]:
    """A comma-separated option's integers: '16,32' -> [16, 32] (empty items dropped)."""
    return [int(x) for x in text.split(",") if x]


def floats(text: str) -> list[float]:
    """A comma-separated option's numbers: '0.5,1' -> [0.5, 1.0] (empty items dropped)."""
    return [float(x) for x in text.split(",") if x]


class CliParser(argparse.ArgumentParser):
    """argparse with usage errors as one `error: ... Fix: see PROG --help` line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        print_error(f"{self.prog}: {message}", f"see {self.prog} --help")
        sys.exit(BAD_INPUT)


def exit_code(e: BaseException) -> int | None:
    """The CLI exit code for one of the project's errors, or None for anything else (a bug: re-raise)."""
    if isinstance(e, RunStopped):
        return STOPPED
    if isinstance(e, (UserError, OSError)):
        return BAD_INPUT
    return None


def run_cli(body: Callable[[], int | None]) -> int:
    """`body()`'s exit code, or 2 / 3 after one error line when it raises a UserError / RunStopped."""
    try:
        return int(body() or 0)
    except (UserError, RunStopped, OSError) as e:
        print_error(e)
        return exit_code(e)
