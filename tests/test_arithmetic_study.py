"""studies.arithmetic at a tiny budget: one row per run with its curve and solved step, resuming from
the rows (nothing retrains), and the table rendered from the rows."""

from __future__ import annotations

from studies.arithmetic import main, read_rows, render


def test_study_writes_one_row_per_run_and_resumes_from_the_rows(tmp_path, capsys):
    rows_path = tmp_path / "rows.jsonl"
    args = ["--digits", "2", "--variants", "standard,mixit", "--seeds", "2", "--steps", "6", "--probe-every", "3"]
    args += ["--probe-samples", "32", "--eval-samples", "64", "--rows", str(rows_path), "--out", str(tmp_path / "out")]
    assert main(args) == 0
    rows = read_rows(rows_path)
    assert sorted((r["variant"], r["seed"]) for r in rows) == [
        ("mixit", 0),
        ("mixit", 1),
        ("standard", 0),
        ("standard", 1),
    ]
    for r in rows:
        assert r["task_args"] == {"n_digits": 2} and r["steps"] == 6 and r["lr"] == 3e-3
        assert [s for s, _ in r["curve"]] == [3, 6] and 0.0 <= r["exact_match"] <= r["acc"] <= 1.0
        assert r["step_solved"] is None or r["step_solved"] in (3, 6)
        assert (
            r["command"].startswith("python -m studies.arithmetic --digits 2")
            and f"--seed-list {r['seed']}" in r["command"]
        )
        assert "train.seq_len=10" in r["overrides"]  # 2 + 1 + 2 + 1 + 3 digits and <eos>: the task's length
    before = rows_path.read_text()
    capsys.readouterr()
    assert main(args) == 0  # every run has its row: nothing trains, the table is printed
    out = capsys.readouterr().out
    assert rows_path.read_text() == before and "[arithmetic]" not in out
    table = render(rows)
    assert table in out
    line = next(x for x in table.splitlines() if x.startswith("| 2 | mixit |"))
    assert "| 6 | 2 |" in line and f"{100 * rows[-1]['exact_match']:.1f}" in table
    # an arm with an override of its own is another row (not "done" by the plain runs) and another table line
    arm = [*args[:3], "mixit", "--seeds", "1", *args[6:], "--override", "model.mixit_residual_scale=0.5"]
    assert main(arm) == 0
    rows = read_rows(rows_path)
    assert len(rows) == 5 and rows[-1]["extra"] == ["model.mixit_residual_scale=0.5"]
    assert "model.mixit_residual_scale=0.5" in rows[-1]["overrides"] and "--override" in rows[-1]["command"]
    assert "| 2 | mixit model.mixit_residual_scale=0.5 | 0.003 | 6 | 1 |" in render(rows)


def test_an_impossible_length_is_one_error_line(tmp_path, capsys):
    assert main(["--digits", "40", "--rows", str(tmp_path / "r.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "n_digits" in err and not (tmp_path / "r.jsonl").exists()
