"""studies.arithmetic at a tiny budget: a rate sweep per (digits, layout, arm), seeds at the chosen rate,
one row per run with its curve and solved step, resuming from the rows (nothing retrains), and the table
rendered from the rows."""

from __future__ import annotations

import argparse
import math

import pytest

from common.errors import StudyError
from pretrain.config import load_recipe
from pretrain.task_model import model_config
from studies.arithmetic import (
    GRID,
    LADDER_CPU_H,
    cells_for,
    chosen_runs,
    main,
    read_rows,
    render,
    render_ladder,
    verdict,
)
from studies.shared import arm_overrides
from studies.spread import wilson


def test_sweep_then_seeds_per_arm_and_layout_resuming_from_the_rows(tmp_path, capsys):
    rows_path = tmp_path / "rows.jsonl"
    common = ["--digits", "2", "--variants", "standard,frozen_qk@0.02", "--steps", "6", "--probe-every", "3"]
    common += ["--grid", "1e-3,3e-3", "--extend", "0", "--probe-samples", "32", "--eval-samples", "64"]
    common += ["--rows", str(rows_path), "--out", str(tmp_path / "out")]
    assert main(["--stage", "sweep", "--layouts", "reference", *common]) == 0
    rows = read_rows(rows_path)
    assert sorted((r["arm"], r["lr"]) for r in rows) == [
        ("frozen_qk@0.02", 1e-3),
        ("frozen_qk@0.02", 3e-3),
        ("standard", 1e-3),
        ("standard", 3e-3),
    ]
    for r in rows:
        assert r["task_args"] == {"n_digits": 2, "layout": "reference"} and r["steps"] == 6 and r["seed"] == 0
        assert [s for s, _ in r["curve"]] == [3, 6] and 0.0 <= r["exact_match"] <= r["acc"] <= 1.0
        assert r["step_solved"] is None or r["step_solved"] in (3, 6)
        assert "train.seq_len=10" in r["overrides"]  # 2 + 1 + 2 + 1 + the sum and <stop> (and <fill>): 3N + 4
        assert ("model.qk_init_std=0.02" in r["overrides"]) == (r["arm"] == "frozen_qk@0.02")
        assert f"--lr {r['lr']:g}" in r["command"] and "--variants " + r["arm"] in r["command"]
    assert main(["--stage", "seeds", "--seeds", "2", "--layouts", "reference", *common]) == 0
    rows = read_rows(rows_path)
    assert len(rows) == 6 and sorted(r["seed"] for r in rows).count(1) == 2  # seed 0 is the sweep's run
    before = rows_path.read_text()
    capsys.readouterr()
    assert main(["--stage", "seeds", "--seeds", "2", "--layouts", "reference", *common]) == 0  # nothing trains
    out = capsys.readouterr().out
    assert rows_path.read_text() == before and "nothing left to train" in out
    table = render(rows)
    assert table in out
    line = next(x for x in table.splitlines() if x.startswith("| 2 | reference | frozen_qk@0.02 |"))
    assert "| 6 | 2 |" in line  # 6 steps, the chosen rate's two seeds
    # no sweep for the padded layout: the seeds stage says which sweep to run, in one line
    assert main(["--stage", "seeds", "--layouts", "padded", *common]) == 2
    assert "run --stage sweep --digits 2 --layouts padded" in capsys.readouterr().err


def test_an_impossible_setting_is_one_error_line(tmp_path, capsys):
    assert main(["--digits", "40", "--rows", str(tmp_path / "r.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "n_digits" in err and not (tmp_path / "r.jsonl").exists()
    assert main(["--variants", "mixit@0.02", "--rows", str(tmp_path / "r.jsonl"), "--out", str(tmp_path)]) == 2
    assert "variant with Q/K" in capsys.readouterr().err


def test_wilson_interval_of_a_solve_rate():
    assert wilson(0, 5) == pytest.approx((0.0, 1.96**2 / (5 + 1.96**2)))  # the closed form at k = 0
    lo, hi = wilson(5, 5)
    assert hi == 1.0 and lo == pytest.approx(5 / (5 + 1.96**2))
    lo, hi = wilson(2, 5)
    assert lo < 0.4 < hi and (lo, hi) == pytest.approx((0.1176, 0.7693), abs=1e-4)


@pytest.mark.parametrize("recipe", ["recipes/reference_addition.yaml", "recipes/retrieval_kv.yaml"])
def test_an_arm_without_a_std_has_the_default_qk_init_whatever_the_recipe_sets(recipe):
    """The reference's recipes set Q/K to 0.02: `standard` must still differ from its control `standard@0.02`
    (the default, 1/sqrt(hidden size); with the recipe's own init the two arms were the same model)."""
    stds = {}
    for arm in ("standard", "standard@0.02", "frozen_qk", "frozen_qk@0.02"):
        cfg = load_recipe(recipe, arm_overrides(arm))
        stds[arm] = model_config(cfg, 64).qk_init_std
    width = model_config(load_recipe(recipe), 64).hidden_size
    assert stds["standard"] == stds["frozen_qk"] == pytest.approx(1 / math.sqrt(width))
    assert stds["standard@0.02"] == stds["frozen_qk@0.02"] == 0.02


def test_a_sweep_only_arm_is_shown_at_its_best_rate_and_seeds_win_once_they_exist():
    def row(lr, seed, exact):
        return {
            "task_args": {"n_digits": 3, "layout": "reference"}, "arm": "mixit", "variant": "mixit", "lr": lr,
            "seed": seed, "steps": 1250, "acc": 0.5 + exact / 2, "exact_match": exact, "loss": 1 - exact,
        }  # fmt: skip

    sweep = [row(3.33e-4, 0, 0.0), row(1e-3, 0, 0.9), row(3e-3, 0, 0.2)]
    assert [r["lr"] for r in chosen_runs(sweep)[(3, "reference", 1250, "mixit")]] == [1e-3]  # not the lowest rate
    seeds = [row(3e-3, s, 0.1) for s in (1, 2)]
    assert [r["seed"] for r in chosen_runs(sweep + seeds)[(3, "reference", 1250, "mixit")]] == [0, 1, 2]


def test_seeds_at_another_rate_chosen_elsewhere_do_not_replace_the_sweeps_choice():
    """The ladder trains 1x again at the rate its 4x sweep chose: with as many seeds at both rates, the
    study's table keeps the rate its own sweep at those steps chose, though the other scores better."""
    sweep = [_row(lr, 0, 1250, None, 0.2 if lr == 1e-3 else 0.6) for lr in (3.33e-4, 1e-3, 3e-3, 1e-2, 3e-2)]
    own = [_row(1e-3, s, 1250, None, 0.3, stage="seeds") for s in range(1, 5)]
    other = [_row(1e-2, s, 1250, 500 if s == 1 else None, 0.1, stage="seeds") for s in range(1, 5)]
    chosen = chosen_runs(sweep + own + other)[(3, "reference", 1250, "mixit")]
    assert [(r["lr"], r["seed"]) for r in chosen] == [(1e-3, s) for s in range(5)]
    # more seeds still win over the sweep's one seed a rate
    assert {r["lr"] for r in chosen_runs(sweep + other)[(3, "reference", 1250, "mixit")]} == {1e-2}


def _row(lr, seed, steps, solved_at, loss, stage="sweep"):
    exact = 1.0 if solved_at else 0.1
    return {
        "task_args": {"n_digits": 3, "layout": "reference"}, "arm": "mixit", "variant": "mixit", "lr": lr,
        "seed": seed, "steps": steps, "acc": 0.5 + exact / 2, "exact_match": exact, "loss": loss,
        "step_solved": solved_at, "stage": stage,
    }  # fmt: skip


def test_a_sweep_of_several_seeds_finishes_every_rate_then_ranks_by_seeds_solved_then_loss():
    args = argparse.Namespace(stage="sweep", steps=40, sweep_seeds=3, grid=[1e-3, 3e-3, 1e-2], extend=1)
    # one seed of 1e-2 solved with the lowest loss, but 3e-3 solved in two: 3e-3 wins once every seed is in
    rows = [_row(1e-3, s, 40, None, 0.6) for s in range(3)] + [
        _row(3e-3, s, 40, 20 if s else None, 0.5) for s in range(3)
    ]
    rows += [_row(1e-2, 0, 40, 20, 0.1)]
    cells = cells_for(args, rows, 3, "reference", "mixit")
    assert {(c.lr, c.seed) for c in cells} == {(lr, s) for lr in (1e-3, 3e-3, 1e-2) for s in range(3)}
    seeds = argparse.Namespace(stage="seeds", steps=160, lr=None, lr_digits=None, lr_steps=40, grid=args.grid,
                               extend=1, seed_list=None, seeds=5)  # fmt: skip
    with pytest.raises(StudyError, match="--sweep-seeds 3"):  # 1e-2 still lacks two seeds: no choice yet
        cells_for(seeds, rows, 3, "reference", "mixit")
    rows += [_row(1e-2, s, 40, None, 0.2) for s in (1, 2)]
    assert {c.lr for c in cells_for(seeds, rows, 3, "reference", "mixit")} == {3e-3}
    assert [c.steps for c in cells_for(seeds, rows, 3, "reference", "mixit")] == [160] * 5
    # a best rate at an edge grows the grid by x3, and the seeds refuse it until that rate is in
    edge = [_row(1e-3, s, 40, 20, 0.3) for s in range(3)] + [
        _row(lr, s, 40, None, 0.5) for lr in (3e-3, 1e-2) for s in range(3)
    ]
    assert {c.lr for c in cells_for(args, edge, 3, "reference", "mixit")} == {3.33e-4, 1e-3, 3e-3, 1e-2}
    with pytest.raises(StudyError, match="edge"):
        cells_for(seeds, edge, 3, "reference", "mixit")


def test_the_ladder_verdict_is_the_pages_rule():
    def runs(k, exact=None):
        return [
            _row(1e-3, s, 40, 20 if s < k else None, 0.1) | ({"exact_match": exact[s]} if exact else {})
            for s in range(5)
        ]

    assert verdict(runs(5), runs(5)) == "holds"
    assert verdict(runs(5), runs(1)) == "refuted"
    assert verdict(runs(2), runs(0)) == "the budget decides nothing"
    assert verdict(runs(5), runs(3)) == "partly (3/5 against 5/5)"


def test_the_ladder_states_a_rungs_verdict_on_the_seeds_its_cpu_cap_left():
    """A rung shows its verdict with 5 seeds an arm; once the rows hold the cap (LADDER_CPU_H), with the
    seeds the cap left (at least 3 an arm, solve fractions compared), and says so."""

    def arm_rows(arm, steps, seeds, stage="seeds", lr=1e-2, solved_at=100):
        return [_row(lr, s, steps, solved_at, 0.01, stage) | {"arm": arm, "variant": arm, "cpu_s": 1.0} for s in seeds]

    sweeps = [r for lr in GRID for r in arm_rows("mixit", 5000, range(3), "sweep", lr, 100 if lr == 1e-2 else None)]
    sweeps += [r for lr in GRID for r in arm_rows("standard", 1250, [0], "sweep", lr, 100 if lr == 3e-3 else None)]
    rungs = arm_rows("mixit", 20000, range(5)) + arm_rows("standard", 20000, range(4), lr=3e-3)

    def rung_verdict(rows):
        line = next(x for x in render_ladder(rows).splitlines() if x.startswith("| 20000 |") and "| mixit |" in x)
        return line.rstrip(" |").rsplit("| ", 1)[1]

    assert rung_verdict(sweeps + rungs) == "—"
    rungs[0]["cpu_s"] = LADDER_CPU_H * 3600
    assert rung_verdict(sweeps + rungs) == "holds (standard 4, MixiT 5 seeds: the cap)"
    assert rung_verdict(sweeps + rungs[:5] + rungs[5:7]) == "—"  # 2 standard seeds: no verdict, cap or not
    assert verdict(rungs[5:9], rungs[:4] + [rungs[4] | {"step_solved": None, "exact_match": 0.1}]) != "holds"
