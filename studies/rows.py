"""Data rows: the JSON-lines files under docs/data that studies write, one row per finished run, and
that the results pages render (studies/results_page.py). One reader and one writer for every study:
appends are whole lines under a lock (threads and processes), so runs finishing side by side never
interleave, a rewrite never loses a row appended meanwhile, and a killed study loses at most its
unfinished runs."""

from __future__ import annotations

import contextlib
import fcntl
import json
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, TextIO

from common.errors import StudyError


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[TextIO]:
    """The row file open for appending under an exclusive flock. Each call opens its own file
    description, so the lock holds against this process's other threads as well as other processes, and
    a rewrite never drops a row a running study appends meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield f


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of the file, in order ([] when there is no file)."""
    path = Path(path)
    if not path.is_file():
        return []
    return _parse(path, path.read_text())


def _parse(path: Path, text: str) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as e:
        raise StudyError(f"{path}: not a JSON-lines row file ({e}). Fix: restore it from git") from None


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    with _locked(Path(path)) as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def update_rows(path: str | Path, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    """Rewrite the file's rows as `change(rows)`, under the file's lock."""
    path = Path(path)
    with _locked(path) as f:
        f.seek(0)
        rows = change(_parse(path, f.read()))
        f.seek(0)
        f.truncate()
        f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def replace_rows(path: str | Path, rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable]) -> None:
    """Write `rows` in place of the file's rows with the same key, keeping every other row."""
    fresh = {key(r) for r in rows}
    update_rows(path, lambda old: [r for r in old if key(r) not in fresh] + rows)
