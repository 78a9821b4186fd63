"""Data rows: the JSON-lines files under docs/data that studies write, one row per finished run, and
that the results pages render (studies/results_page.py). One reader and one writer for every study:
appends are whole lines under a lock, so runs finishing side by side never interleave, and a killed
study loses at most its unfinished runs."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable, Hashable

from common.errors import StudyError

_LOCK = threading.Lock()


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of the file, in order ([] when there is no file)."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except ValueError as e:
        raise StudyError(f"{path}: not a JSON-lines row file ({e}). Fix: restore it from git") from None


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    path = Path(path)
    with _LOCK:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def replace_rows(path: str | Path, rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable]) -> None:
    """Write `rows` in place of the file's rows with the same key, keeping every other row."""
    path = Path(path)
    fresh = {key(r) for r in rows}
    with _LOCK:
        kept = [r for r in read_rows(path) if key(r) not in fresh]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept + rows))
