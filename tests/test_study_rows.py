"""studies/rows.py: the one reader and writer of the data rows every study writes and the pages render."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common.errors import StudyError
from studies.rows import append_row, read_rows, replace_rows, update_rows

REPO = Path(__file__).resolve().parent.parent


def test_appends_from_threads_are_whole_lines_and_replace_keeps_other_keys(tmp_path):
    path = tmp_path / "sub" / "rows.jsonl"
    assert read_rows(path) == []
    threads = [
        threading.Thread(
            target=lambda i=i: [append_row(path, {"run": f"r{i}", "k": j, "pad": "x" * 5000}) for j in range(20)]
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = read_rows(path)
    assert sorted((r["run"], r["k"]) for r in rows) == sorted((f"r{i}", j) for i in range(4) for j in range(20))
    replace_rows(path, [{"run": "r0", "k": -1}], key=lambda r: r["run"])
    rows = read_rows(path)
    assert [r for r in rows if r["run"] == "r0"] == [{"run": "r0", "k": -1}] and len(rows) == 61


def test_a_broken_row_file_is_a_study_error_naming_it(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"run": "a"}\n{"run": \n')
    with pytest.raises(StudyError, match="rows.jsonl: not a JSON-lines row file.*Fix: restore it from git"):
        read_rows(path)


def test_a_rewrite_does_not_lose_a_row_another_process_appends_meanwhile(tmp_path):
    """A study appends rows while `studies.scaling recollect` rewrites the file: the other process's
    append waits for the rewrite (flock) instead of landing in the middle and being overwritten."""
    path = tmp_path / "rows.jsonl"
    append_row(path, {"run": "a"})
    code = f"from studies.rows import append_row; append_row({str(path)!r}, {{'run': 'b'}})"
    child = []

    def slow_change(rows):
        child.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO))
        time.sleep(1.5)  # the child starts and reaches its append meanwhile
        return [{**r, "seen": True} for r in rows]

    update_rows(path, slow_change)
    assert child[0].wait(timeout=60) == 0
    assert read_rows(path) == [{"run": "a", "seen": True}, {"run": "b"}]
