"""One line for bad input: every command-line tool prints `error: ... Fix: ...` and exits non-zero,
never a traceback.

`CliParser` is an ArgumentParser whose usage errors (a missing or misspelt option, a bad value) are
that one line; `run_cli(fn, errors)` runs a CLI's body and turns the exception types it is given into
that line (exit 2). Each layer passes the errors it knows about: the data pipeline `DATA_ERRORS`,
the layers above add theirs (pretrain.errors.INPUT_ERRORS, eval.loading.EVAL_ERRORS). It sits at the
bottom layer so that every CLI, whatever its layer, can use it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

from .errors import DataError

# A data problem the user can fix, and a path that is missing, unreadable or on a full disk.
DATA_ERRORS: tuple[type[BaseException], ...] = (DataError, OSError)
DEFAULT_FIX = "check the paths and values named above (--help lists the options)"


def error_line(e: BaseException | str, fix: str | None = None) -> str:
    """`error: MESSAGE. Fix: ...` on one line; the message's own `Fix:` is kept, else `fix` is added."""
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in msg:
        msg += f": {e.filename}"
    if "Fix:" not in msg:
        msg = f"{msg.rstrip('. ')}. Fix: {fix or DEFAULT_FIX}"
    return f"error: {msg}"


def print_error(e: BaseException | str, fix: str | None = None) -> None:
    print(error_line(e, fix), file=sys.stderr, flush=True)


class CliParser(argparse.ArgumentParser):
    """argparse with usage errors as one `error: ... Fix: see PROG --help` line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        print_error(f"{self.prog}: {message}", f"see {self.prog} --help")
        sys.exit(2)


def run_cli(
    body: Callable[[], int | None], errors: tuple[type[BaseException], ...] = DATA_ERRORS, code: int = 2
) -> int:
    """`body()`'s exit code, or `code` after one error line when it raises one of `errors`."""
    try:
        return int(body() or 0)
    except errors as e:
        print_error(e)
        return code
