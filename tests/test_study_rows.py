"""studies/rows.py: the one reader and writer of the data rows every study writes and the pages render."""

from __future__ import annotations

import threading

import pytest

from common.errors import StudyError
from studies.rows import append_row, read_rows, replace_rows


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
