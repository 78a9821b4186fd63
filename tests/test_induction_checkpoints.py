"""studies.induction_checkpoints: a run's kept checkpoints probed one row each, skipped once their row
exists, and a path that is not a run dir refused in one line."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO

from pretrain.train import train
from studies.induction_checkpoints import main, read_rows


def test_every_kept_checkpoint_is_probed_once_on_the_runs_held_out_text(tmp_path, capsys):
    run = tmp_path / "run"
    text = f"text:{REPO / 'data/sample/valid.jsonl'}"
    overrides = ["model.variant=standard", f"data.source={text}", "data.val_fraction=0.2", "train.max_steps=4",
                 "checkpoint.every_steps=2", "checkpoint.keep_last=0", "train.eval_every_steps=2", "train.seq_len=64"]  # fmt: skip
    train(str(REPO / "recipes/tiny_cpu.yaml"), overrides, run_dir=run)
    rows_path = tmp_path / "rows.jsonl"
    assert main(["--runs", str(run), "--rows", str(rows_path)]) == 0
    rows = read_rows(rows_path)
    assert [r["step"] for r in rows] == [2, 4] and {r["variant"] for r in rows} == {"standard"}
    for r in rows:
        assert r["val_step"] == r["step"] and r["flops"] > 0 and 0.0 <= r["induction_score_text"] <= 1.0
        assert r["tokens"] == r["step"] * 8 * 64
    before = rows_path.read_text()
    capsys.readouterr()
    assert main(["--runs", str(run), "--rows", str(rows_path)]) == 0  # nothing probed again
    out = capsys.readouterr().out
    assert rows_path.read_text() == before and "| run | 2 |" in out and "| run | 4 |" in out
    assert main(["--runs", str(Path(tmp_path / "nothing")), "--rows", str(rows_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Fix:" in err and len(err.strip().splitlines()) == 1
