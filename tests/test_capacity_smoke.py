"""The memorization-capacity sweep runs at its smallest size (all four of the paper's variants)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from common.errors import StudyError
from data_pipeline.synthetic import memorization_capacity_bits
from pretrain.train import train
from studies.capacity import (
    PAPER_BITS_PER_PARAM,
    SMOKE,
    cell_overrides,
    check_same_cell,
    loss_drop,
    main,
    run_cell,
    table,
    training_losses,
)
from studies.loss_curves import main as loss_curves
from studies.shared import without

RECIPE = "recipes/capacity_memorization.yaml"


def test_capacity_smoke_sweep_writes_the_table(tmp_path):
    assert main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "capacity.json").read_text())
    assert [r["variant"] for r in rows] == ["standard", "frozen_qk", "mixit", "frozen_mlp"]
    for r in rows:
        assert r["width"] == SMOKE["widths"][0] and r["layers"] == 2 and r["n_pairs"] == 64
        assert r["bits"] == memorization_capacity_bits(64, 4, r["acc"])
        assert math.isclose(r["bits_per_trainable_param"], r["bits"] / r["params_trainable"])
        assert r["params_trainable"] <= r["params_total"]
    by = {r["variant"]: r for r in rows}
    assert (
        by["frozen_mlp"]["params_trainable"] < by["frozen_qk"]["params_trainable"] < by["standard"]["params_trainable"]
    )
    md = (tmp_path / "capacity.md").read_text()
    for v, bits in PAPER_BITS_PER_PARAM.items():
        assert f"| {v} |" in md and str(bits) in md
    assert (tmp_path / "capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(training_losses(tmp_path / "standard_w8")) > 0
    # the trainer's run directories are what studies.loss_curves reads
    assert loss_curves([f"{tmp_path / 'standard_w8'}=standard", "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second seed trains only the new cell (seed 0's result is kept), re-initialised with its own seed
    before = (tmp_path / "mixit_w8" / "study_result.json").read_text()
    assert main(["--smoke", "--out-dir", str(tmp_path), "--variants", "mixit", "--seeds", "2"]) == 0
    assert (tmp_path / "mixit_w8" / "study_result.json").read_text() == before
    cfg = yaml.safe_load((tmp_path / "mixit_w8_s1" / "config.yaml").read_text())
    assert cfg["seed"] == 1235 and cfg["model"]["mixit_seed"] == 1
    rows = json.loads((tmp_path / "capacity.json").read_text())
    assert [r["seed_index"] for r in rows] == [0, 1]
    assert " ± " in (tmp_path / "capacity.md").read_text()


def test_first_seed_runs_a_later_seed_alone_and_the_whole_study_reads_it_back(tmp_path):
    """Seeds as separate jobs: --first-seed 1 trains seed 1 only; --seeds 2 then adds seed 0 and keeps seed 1."""
    assert main(["--smoke", "--out-dir", str(tmp_path), "--variants", "mixit", "--first-seed", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["mixit_w8_s1"]
    assert [r["seed_index"] for r in json.loads((tmp_path / "capacity.json").read_text())] == [1]
    cfg = yaml.safe_load((tmp_path / "mixit_w8_s1" / "config.yaml").read_text())
    assert cfg["seed"] == 1235 and cfg["model"]["mixit_seed"] == 1
    before = (tmp_path / "mixit_w8_s1" / "study_result.json").read_text()
    assert main(["--smoke", "--out-dir", str(tmp_path), "--variants", "mixit", "--seeds", "2"]) == 0
    assert (tmp_path / "mixit_w8_s1" / "study_result.json").read_text() == before
    assert [r["seed_index"] for r in json.loads((tmp_path / "capacity.json").read_text())] == [0, 1]


def test_gather_reports_every_finished_cell_whatever_command_made_it(tmp_path, capsys):
    """Cells of different seeds and variants, from separate commands, in one table; nothing is trained."""
    assert main(["--smoke", "--out-dir", str(tmp_path), "--variants", "standard"]) == 0
    assert main(["--smoke", "--out-dir", str(tmp_path), "--variants", "mixit", "--first-seed", "1"]) == 0
    (tmp_path / "capacity.png").unlink()
    cells = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert main(["--gather", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "capacity.json").read_text())
    assert [(r["variant"], r["seed_index"]) for r in rows] == [("standard", 0), ("mixit", 1)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == cells  # no cell trained
    assert (tmp_path / "capacity.png").is_file() and "| mixit |" in (tmp_path / "capacity.md").read_text()
    capsys.readouterr()
    assert main(["--gather", "--out-dir", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "holds no finished cell" in err and "Fix:" in err


def test_table_shows_the_best_width_per_variant():
    rows = [
        {
            "variant": "standard",
            "width": w,
            "params_trainable": 10,
            "params_total": 10,
            "data_bits": 100.0,
            "acc": 0.5,
            "bits": b,
            "bits_per_trainable_param": b / 10,
            "bits_per_param": b / 10,
        }
        for w, b in ((8, 10.0), (16, 25.0))
    ]
    assert "| 2.500 | 2.98 |" in table(rows)


def test_loss_drop_reads_the_tail_of_the_curve():
    flat = {s: 1.0 for s in range(1, 101)}
    falling = {s: 2.0 - s / 100 for s in range(1, 101)}
    assert loss_drop(flat) == 0.0
    # the last 20 steps: mean of steps 81-85 (1.17) minus mean of steps 96-100 (1.02)
    assert abs(loss_drop(falling) - 0.15) < 1e-9


def test_loss_drop_reads_step_windows_whatever_the_logging_density():
    # logged every 10 steps up to a resume at step 90, every step after it: the same windows as dense logging
    falling = {s: 2.0 - s / 100 for s in range(1, 101)}
    mixed = {s: v for s, v in falling.items() if s % 10 == 0 or s > 90}
    # the window 81-85 was not logged: the first logged step after 80 (90) stands for it
    assert abs(loss_drop(mixed) - (1.10 - 1.02)) < 1e-9
    dense_tail = {s: v for s, v in falling.items() if s % 10 == 0 or s > 80}
    assert abs(loss_drop(dense_tail) - loss_drop(falling)) < 1e-9


def test_an_unfinished_cell_continues_from_its_checkpoint(tmp_path):
    over = SMOKE["overrides"] + ["checkpoint.every_steps=10"]
    straight = run_cell(RECIPE, "frozen_qk", 8, over, tmp_path / "straight")
    assert straight["resumed_from"] is None and straight["steps"] == 20
    # the same cell stopped at step 10 (as a killed or preempted job leaves it), then run again
    part = train(
        RECIPE, cell_overrides(RECIPE, over, "frozen_qk", 8, 3, 0), run_dir=tmp_path / "split", stop_after_steps=10
    )
    assert part.final_step == 10
    resumed = run_cell(RECIPE, "frozen_qk", 8, over, tmp_path / "split")
    assert resumed["resumed_from"] == "step_00000010" and resumed["steps"] == 20
    for key in ("acc", "final_loss", "loss_drop_last_20pct", "params_trainable"):
        assert resumed[key] == straight[key], key
    assert training_losses(tmp_path / "split") == training_losses(tmp_path / "straight")


def test_a_finished_cell_is_reused_only_by_the_command_that_made_it(tmp_path, capsys):
    base = ["--smoke", "--out-dir", str(tmp_path), "--variants", "standard"]
    assert main(base) == 0
    assert main(base) == 0  # the same command: the cell is read back, not trained again
    # another command is refused before any cell trains (mixit would have trained first)
    assert main(["--smoke", "--out-dir", str(tmp_path), "--variants", "mixit,standard", "train.max_steps=30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "train.max_steps=30" in err and "Fix: another --out-dir" in err
    assert not (tmp_path / "mixit_w8").exists()
    # an unfinished cell is continued only towards the same number of steps
    train(
        RECIPE,
        cell_overrides(RECIPE, SMOKE["overrides"], "mixit", 8, 3, 0),
        run_dir=tmp_path / "mixit_w8",
        stop_after_steps=5,
    )
    assert main(["--smoke", "--out-dir", str(tmp_path), "--variants", "mixit", "train.max_steps=30"]) == 2
    assert "unfinished cell of train.max_steps=20" in capsys.readouterr().err
    (tmp_path / "standard_w8" / "study_result.json").write_text("{not json")
    assert main(base) == 2
    assert "is not a cell's result" in capsys.readouterr().err
    with pytest.raises(StudyError, match="finished by another command"):
        check_same_cell({"recipe": "other.yaml", "overrides": []}, RECIPE, [], tmp_path)


def test_parallel_sweep_trains_every_cell_in_worker_processes(tmp_path):
    assert (
        main(["--smoke", "--out-dir", str(tmp_path), "--variants", "standard,mixit,frozen_mlp", "--parallel", "2"]) == 0
    )
    rows = json.loads((tmp_path / "capacity.json").read_text())
    assert [r["variant"] for r in rows] == ["standard", "mixit", "frozen_mlp"]

    # worker 0 trained standard and frozen_mlp, worker 1 mixit: each logged its own cells
    def cells(log):
        return [line.split()[0] for line in log.read_text().splitlines() if " width " in line and " seed " in line]

    assert cells(tmp_path / "train_0.log") == ["standard", "frozen_mlp"]
    assert cells(tmp_path / "train_1.log") == ["mixit"]
    assert (tmp_path / "capacity.png").is_file() and "| mixit |" in (tmp_path / "capacity.md").read_text()


def test_without_drops_an_option_and_its_value():
    argv = ["--smoke", "--variants", "a,b", "--parallel=2", "--out-dir", "x", "train.max_steps=5"]
    assert without(argv, "--variants", "--parallel") == ["--smoke", "--out-dir", "x", "train.max_steps=5"]
