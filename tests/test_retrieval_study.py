"""studies.retrieval: the baselines against the task's own generator, the study end to end at a
tiny budget (sweep with its grid growing past an edge, seeds reusing the sweep's run, resuming from
the rows, the CPU budget), and the page's table against the committed rows."""

import argparse
import math
import re

import numpy as np
import pytest
from conftest import REPO

from common.errors import StudyError
from data_pipeline.synthetic import get_task
from studies.retrieval import (
    PAGE,
    ROWS,
    TABLE_BEGIN,
    TABLE_END,
    bag_loss_exact,
    build_parser,
    cells_for,
    context_guesses,
    did_not_train,
    main,
    mode_guess_exact,
    read_rows,
    render,
    retrieval_score,
    slot_guess_exact,
    sweep_rows,
    time_to_solve,
)
from studies.shared import best_rate


@pytest.mark.parametrize("n_pairs,n_values", [(4, 8), (6, 3)])
def test_exact_guesses_match_the_generator(n_pairs, n_values):
    task = get_task("kv_retrieval", seed=7, n_pairs=n_pairs, n_keys=8, n_values=n_values)
    mc = context_guesses(task, 6000)
    # per-example guesses lie in [0, 1]: the Monte Carlo standard error is below 0.0065
    assert abs(mc["slot_guess_mc"] - slot_guess_exact(n_pairs, n_values)) < 0.026
    assert abs(mc["mode_guess_mc"] - mode_guess_exact(n_pairs, n_values)) < 0.026
    assert mc["bag_loss_mc"] == pytest.approx(bag_loss_exact(n_pairs, n_values), abs=0.05)


def test_mode_guess_exact_against_enumeration():
    """Every assignment of n values from V, counted: the float64 reference for the occupancy formula."""
    n_pairs, n_values = 5, 3
    per_n = []
    for n in range(1, n_pairs + 1):
        grids = np.stack(np.meshgrid(*[np.arange(n_values)] * n, indexing="ij"), -1).reshape(-1, n)
        counts = np.stack([(grids == v).sum(1) for v in range(n_values)], 1)
        per_n.append(float(np.mean(counts.max(1) / n)))
    assert mode_guess_exact(n_pairs, n_values) == pytest.approx(np.mean(per_n), abs=1e-12)


def _row(lr, acc, loss, seed=0):
    return {
        "task_args": {"n_pairs": 16, "n_keys": 32, "n_values": 32},
        "variant": "standard",
        "lr": lr,
        "seed": seed,
        "steps": 10,
        "acc": acc,
        "loss": loss,
    }


def test_best_rate_by_accuracy_then_loss():
    rows = [_row(1e-3, 0.5, 2.0), _row(3e-3, 0.5, 1.5), _row(3e-4, 0.4, 1.0), _row(3e-3, 0.9, 0.1, seed=1)]
    assert best_rate(sweep_rows(rows, 16, "standard", 10), retrieval_score) == (3e-3, [3e-4, 1e-3, 3e-3])
    assert best_rate(sweep_rows(rows, 30, "standard", 10), retrieval_score) == (None, [])
    diverged = {**_row(9e-3, None, None), "curve": [], "step_solved": None, "cpu_s": 1.0}
    assert best_rate(sweep_rows([*rows, diverged], 16, "standard", 10), retrieval_score) == (
        3e-3,
        [3e-4, 1e-3, 3e-3, 9e-3],
    )
    assert "| 16 | 32 | standard | 10 | 0.009 | diverged | — | — |" in render([diverged])


def test_study_end_to_end_resumes_from_rows(tmp_path, capsys):
    rows_path, page = tmp_path / "rows.jsonl", tmp_path / "page.md"
    common = ["--pairs", "2", "--variants", "standard,mixit", "--steps", "6", "--probe-every", "3"]
    common += [
        "--probe-samples",
        "32",
        "--eval-samples",
        "64",
        "--rows",
        str(rows_path),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(["--stage", "sweep", "--grid", "1e-3,3e-3", "--extend", "1", *common]) == 0
    rows = read_rows(rows_path)
    for variant in ("standard", "mixit"):
        mine = [r for r in rows if r["variant"] == variant]
        rates = sorted(r["lr"] for r in mine)
        assert len(rates) == 3 and {1e-3, 3e-3} < set(rates)  # the grid grew by one rate past an edge
        extra = (set(rates) - {1e-3, 3e-3}).pop()
        best_of_grid = max((r for r in mine if r["lr"] in (1e-3, 3e-3)), key=lambda r: (r["acc"], -r["loss"]))
        assert extra == pytest.approx(best_of_grid["lr"] * (3 if best_of_grid["lr"] == 3e-3 else 1 / 3), rel=1e-2)
    for r in rows:
        assert r["steps"] == 6 and r["seed"] == 0 and r["task_args"]["n_pairs"] == 2
        assert [s for s, _ in r["curve"]] == [3, 6] and 0.0 <= r["acc"] <= 1.0 and r["cpu_s"] >= 0
        assert r["command"].startswith("python -m studies.retrieval") and f"--lr {r['lr']:g}" in r["command"]

    seeds = ["--stage", "seeds", "--seeds", "2", "--extend", "1", "--grid", "1e-3,3e-3", *common]
    assert main(seeds) == 0  # seed 0 is the sweep's run at the best rate: one new run per variant
    rows = read_rows(rows_path)
    assert len(rows) == 8 and sorted(r["seed"] for r in rows).count(1) == 2
    before = rows_path.read_text()
    capsys.readouterr()
    assert main(seeds) == 0  # every cell has its row: nothing trains
    assert rows_path.read_text() == before and "nothing left to train" in capsys.readouterr().out
    assert main(["--stage", "curve", "--lr", "1e-3", "--budget-cpu-h", "0", *common]) == 0
    assert (
        rows_path.read_text() == before and not (tmp_path / "out" / "runs" / "p2-standard-lr0.001-s1-n6-v32").exists()
    )

    page.write_text(f"# page\n\n{TABLE_BEGIN}\nold\n{TABLE_END}\nafter\n")
    assert main(["--render", "--rows", str(rows_path), "--page", str(page)]) == 0
    text = page.read_text()
    for variant in ("standard", "mixit"):
        line = next(x for x in text.splitlines() if x.startswith(f"| 2 (32, 32) | {variant} |"))
        seed_accs = [100 * r["acc"] for r in rows if r["variant"] == variant and r["seed"] == 1]
        assert "| 6 | 2 |" in line and f"{seed_accs[0]:.1f}" in line  # 6 steps, the best rate's two seeds
        assert re.search(r"\| 6 \| 2 \| [0-2]/2 \|", line), line  # how many of them trained
    assert "*chance (1/32)* | | | | | 3.1 %" in text and "after" in text and "old" not in text


def test_page_table_is_rendered_from_the_committed_rows():
    rows = read_rows(REPO / ROWS)
    text = (REPO / PAGE).read_text()
    table = re.search(re.escape(TABLE_BEGIN) + r"\n(.*)\n" + re.escape(TABLE_END), text, re.S).group(1)
    assert table == (render(rows) if rows else "(no runs yet)"), "run: python -m studies.retrieval --render"
    for r in rows:  # every row names the command that reproduces it
        assert r["command"].startswith("python -m studies.retrieval")


def test_time_to_solve_fits_a_power_law_to_the_solved_medians_and_extrapolates():
    """Rows whose medians follow step = 25 * pairs^2 exactly: the fit recovers it; a pair count whose seeds
    never solved it gets the extrapolated budget, flagged where the steps trained there already exceed it."""
    rows = []
    for pairs, seeds in ((4, (400, 300, 500)), (8, (1600, 1500, 1700)), (16, (None, None))):
        for i, step in enumerate(seeds):
            rows.append({**_row(3e-4, 0.3 if step is None else 1.0, 1.0, seed=i), "step_solved": step})
            rows[-1]["task_args"] = {"n_pairs": pairs}
            rows[-1]["steps"] = 3000
    lines = "\n".join(time_to_solve(rows))
    assert "| 4 | 3000 | 3 | 3/3 | 400, 300, 500 | 400 |" in lines and "| 16 | 3000 | 2 | 0/2 | —, — | — |" in lines
    assert "step ≈ 25 · pairs^2.00" in lines and "16 pairs ~6,400 steps." in lines  # more than the 3000 trained
    rows[-1]["steps"] = rows[-2]["steps"] = 8000
    assert "16 pairs ~6,400 steps (below the steps trained there" in "\n".join(time_to_solve(rows))


def test_a_rate_that_diverges_gets_a_row_without_scores(tmp_path):
    rows_path = tmp_path / "rows.jsonl"
    argv = ["--stage", "curve", "--lr", "1e30", "--seeds", "1", "--pairs", "2", "--variants", "standard"]
    argv += ["--steps", "4", "--probe-every", "2", "--probe-samples", "8", "--rows", str(rows_path)]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    (row,) = read_rows(rows_path)
    assert "non-finite" in row["diverged"] and row["acc"] is None and row["loss"] is None
    assert row["eval_samples"] == 0 and row["step_solved"] is None and row["cpu_s"] > 0


def test_stage_all_stops_where_the_budget_is_spent(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    assert main(["--stage", "all", "--budget-cpu-h", "0", "--rows", str(rows), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[sweep] CPU budget spent" in out and "[seeds]" not in out and not rows.exists()


def _kv_row(lr, seed, acc, loss, values=255, steps=1562, stage="sweep"):
    return {
        "task_args": {"n_pairs": 30, "n_keys": 32, "n_values": values, "min_pairs": 1}, "arm": "mixit",
        "variant": "mixit", "lr": lr, "seed": seed, "steps": steps, "acc": acc, "loss": loss, "stage": stage,
    }  # fmt: skip


def test_a_run_at_the_loss_of_knowing_only_that_the_answer_is_a_value_did_not_train():
    ln_v = math.log(255)
    assert did_not_train(_kv_row(1e-3, 0, 0.004, ln_v + 0.001))  # MixiT's 30-pair rows: at ln V to 3 decimals
    assert did_not_train(_kv_row(1e-3, 0, None, None))  # diverged
    assert not did_not_train(_kv_row(1e-3, 0, 0.05, ln_v - 0.2))  # used the context a little: trained
    assert not did_not_train(_kv_row(1e-3, 0, 0.2, 2.4))  # the bag of values: trained, near G


def test_a_seeded_sweep_ranks_rates_by_seeds_that_trained_and_the_seeds_read_it_at_lr_steps():
    args = build_parser().parse_args(["--pairs", "30", "--values", "255", "--variants", "mixit"])
    sweep = argparse.Namespace(**{**vars(args), "stage": "sweep", "sweep_seeds": 2, "grid": [3.33e-4, 1e-3, 3e-3]})
    ln_v = math.log(255)
    # 3e-3 has the best single seed, but 1e-3 trained in both of its seeds
    rows = [_kv_row(3.33e-4, s, 0.004, ln_v) for s in range(2)]
    rows += [_kv_row(1e-3, s, 0.05, ln_v - 0.3) for s in range(2)]
    rows += [_kv_row(3e-3, 0, 0.3, 2.0), _kv_row(3e-3, 1, 0.004, ln_v)]
    assert cells_for(sweep, rows, 30, "mixit") == cells_for(sweep, rows[:4], 30, "mixit")  # every rate, both seeds
    seeds = argparse.Namespace(**{**vars(sweep), "stage": "seeds", "steps": 4 * 1562, "lr_steps": 1562})
    cells = cells_for(seeds, rows, 30, "mixit")
    assert {c.lr for c in cells} == {1e-3} and {c.steps for c in cells} == {4 * 1562} and len(cells) == 5
    with pytest.raises(StudyError, match="--sweep-seeds 2"):  # a rate with one seed of two: no choice yet
        cells_for(seeds, rows[:-1], 30, "mixit")
