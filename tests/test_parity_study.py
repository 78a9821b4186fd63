"""studies.parity at a tiny budget: the reference's task at its settings, one row per run, resuming from
the rows, and the table beside the reference's rows with the gap rule applied."""

from __future__ import annotations

from studies.parity import gap_verdict, main, read_rows, render
from studies.spread import Spread


def test_parity_run_rows_and_table(tmp_path, capsys):
    rows_path = tmp_path / "rows.jsonl"
    args = ["--tasks", "additionstream_3", "--variants", "standard,mixit", "--seed-list", "0"]
    args += ["--override", "train.max_steps=4", "--probe-every", "2", "--probe-samples", "16", "--eval-samples", "32"]
    args += ["--rows", str(rows_path), "--out", str(tmp_path / "out"), "--reference-rows", str(tmp_path / "none.jsonl")]
    assert main(args) == 0
    rows = read_rows(rows_path)
    assert sorted(r["variant"] for r in rows) == ["mixit", "standard"]
    for r in rows:
        assert r["task_args"] == {"n_digits": 3, "layout": "reference"} and r["lr"] == 1e-2
        assert "train.seq_len=13" in r["overrides"] and "model.max_seq_len=13" in r["overrides"]  # 3N + 4
        assert 0.0 <= r["exact_match"] <= r["acc"] <= 1.0 and r["eval_samples"] == 32
    before = rows_path.read_text()
    assert main(args) == 0 and rows_path.read_text() == before  # every run has its row: nothing trains
    reference = [{"ref_task": "additionstream_3", "variant": "standard", "acc": 0.5, "seed": 43}]
    table = render([{**r, "extra": []} for r in rows], reference)
    line = next(x for x in table.splitlines() if x.startswith("| additionstream_3 | standard |"))
    assert "| 0.500 |" in line and ("| no |" in line or "| yes (" in line) and line.endswith(", 0/1 |")
    assert "| additionstream_3 | mixit | 1 |" in table and "| — | — |" in table  # no reference row: no verdict


def test_gap_rule():
    assert gap_verdict(Spread.of([1.0, 1.0, 1.0]), [1.0, 1.0]) == "no"
    assert gap_verdict(Spread.of([0.35, 0.33, 0.36]), [0.332, 0.352]) == "no"
    assert gap_verdict(Spread.of([0.76, 0.78, 0.74]), [0.9999]) == "yes (-0.240)"
    assert gap_verdict(Spread.of([0.76, 0.99, 0.98]), [0.9999]) == "no"  # the seeds' spread covers it
