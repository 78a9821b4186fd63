"""The IsoFLOP analysis on rows drawn from a known law: the optima, the exponents and a variant's compute
multiplier come back; an optimum beyond the sizes run is "not identified" and kept out of the laws;
paired gaps are the differences at the same seed."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from common.errors import StudyError
from studies.scaling.cli import main
from studies.scaling.profiles import (
    analyse,
    plot_multipliers,
    reached_by,
    report_markdown,
    shift_rows,
    standard_curve,
    vertex,
)

# L(N, D) = A N^-a + B D^-b with C = 6 N D: the optimum is an exact power law in C,
# N* = G (C/6)^(b/(a+b)) with G = (aA / bB)^(1/(a+b)), and L* ~ C^(-ab/(a+b)).
A, ALPHA, B, BETA = 400.0, 0.34, 410.0, 0.28
BUDGETS = [1e15, 2e15, 4e15, 8e15]


def law(N, D):
    return A * N**-ALPHA + B * D**-BETA


def n_star(C):
    G = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    return G * (C / 6) ** (BETA / (ALPHA + BETA))


def rows_from_law(variant="standard", k=1.0, seeds=1, noise=0.0, shift=1.0, rng=None):
    """IsoFLOP rows: 7 sizes spaced 1.6x around each budget's optimum (times `shift`); a variant whose
    data is worth `k` times standard's, so its compute multiplier is exactly k."""
    rows = []
    for C in BUDGETS:
        for i in range(-3, 4):
            N = n_star(C) * shift * 1.6**i
            D = C / (6 * N)
            for seed in range(seeds):
                loss = law(N, k * D) + (rng.normal(0, noise) if noise else 0.0)
                rows.append({"variant": variant, "budget": C, "size": f"x{i}", "seed": seed, "cooled": True,
                             "non_embedding_params": N, "tokens": D, "final_val_loss": loss,
                             "flops": C, "steps": 1000})  # fmt: skip
    return rows


def test_vertex_and_edges():
    x = np.log([1, 2, 4, 8, 16.0])
    assert vertex(x, (x - math.log(4)) ** 2 + 3)[0] == pytest.approx(math.log(4))
    assert vertex(x, -((x - 1) ** 2)) is None  # opens downward
    assert vertex(x, (x - math.log(64)) ** 2) is None  # the lowest loss at the edge: beyond the sizes


def test_optima_laws_and_multiplier_come_back_from_the_law(tmp_path):
    rng = np.random.default_rng(0)
    rows = rows_from_law(seeds=2, noise=0.002, rng=rng) + rows_from_law("mixit", k=0.25, seeds=2, noise=0.002, rng=rng)
    result = analyse(rows, n_boot=300)
    std = result["profiles"]["standard"]
    for C, p in std.items():
        assert p.status == "identified"
        assert math.exp(p.vertex[0]) == pytest.approx(n_star(C), rel=0.15)
    laws = result["laws"]["standard"]
    assert laws["N"]["exponent"] == pytest.approx(BETA / (ALPHA + BETA), abs=0.05)
    assert laws["L"]["exponent"] == pytest.approx(-ALPHA * BETA / (ALPHA + BETA), abs=0.01)
    lo, hi = laws["N"]["interval"]
    assert lo < laws["N"]["exponent"] < hi
    assert result["noise"]["standard"]["from"].startswith("seeds")
    assert result["noise"]["standard"]["sigma"] == pytest.approx(0.002, rel=0.5)
    m = result["multipliers"]["mixit"]
    for e in m["per_budget"].values():  # the data is worth a quarter: standard reaches mixit's loss at C/4
        assert e["multiplier"] == pytest.approx(0.25, rel=0.1)
        assert e["interval"][0] < e["multiplier"] < e["interval"][1]
    assert abs(m["trend"]["per_decade"]) < 0.05 and not m["trend"]["moves"]
    # mixit's L* at the smallest budget lies above standard's measured optima: flagged as extrapolated
    assert m["per_budget"][BUDGETS[0]]["extrapolated"] and not m["per_budget"][BUDGETS[-1]]["extrapolated"]
    # and gets the law-free bound from rows: standard's own smallest budget has runs below that loss
    assert m["per_budget"][BUDGETS[0]]["at_most"] == 1.0 and "at_most" not in m["per_budget"][BUDGETS[-1]]
    assert f"{m['per_budget'][BUDGETS[0]]['multiplier']:.3g}" in report_markdown(result)
    assert "(extrapolated); from rows: at most 1 " in report_markdown(result)
    held = result["held_out"]
    assert abs(held["standard"]["relative_error"]) < 0.02 and held["mixit"]["multiplier_predicted"] == pytest.approx(
        0.25, rel=0.15
    )
    assert plot_multipliers(result, tmp_path / "m.png").stat().st_size > 0
    gaps = {(g["variant"], g["budget"], g["size"]): g for g in result["paired_gaps"]}
    g = gaps[("mixit", BUDGETS[0], "x0")]
    assert g["seeds"] == 2 and g["gap"] > 0 and g["interval"] is not None


def test_a_budget_beyond_the_grid_is_predicted_from_the_laws(tmp_path, capsys):
    """L* and N* at 4x and 16x the largest budget come back from the known law, inside their intervals, and
    a variant worth a quarter of standard's data is predicted at a quarter there too."""
    rng = np.random.default_rng(1)
    rows = rows_from_law(seeds=2, noise=0.002, rng=rng) + rows_from_law("mixit", k=0.25, seeds=2, noise=0.002, rng=rng)
    beyond = [4 * BUDGETS[-1], 16 * BUDGETS[-1]]
    result = analyse(rows, n_boot=300, predict_at=[BUDGETS[-1], *beyond])
    # mixit's L* at C is standard's at C/4: inside standard's measured optima at the grid's top, beyond them at 16x
    assert not result["predicted"]["mixit"][BUDGETS[-1]]["extrapolated"]
    assert result["predicted"]["mixit"][beyond[-1]]["extrapolated"]
    for C in beyond:
        std, mixit = result["predicted"]["standard"][C], result["predicted"]["mixit"][C]
        n, d = n_star(C), C / (6 * n_star(C))
        assert std["L_star"] == pytest.approx(law(n, d), rel=0.01)
        assert std["N_star"] == pytest.approx(n, rel=0.2)
        assert std["L_interval"][0] < std["L_star"] < std["L_interval"][1] and "multiplier" not in std
        assert mixit["multiplier"] == pytest.approx(0.25, rel=0.15)
        assert mixit["multiplier_interval"][0] < mixit["multiplier"] < mixit["multiplier_interval"][1]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(["profiles", "--rows", str(path), "--out", str(tmp_path / "p"), "--boot", "50", "--predict", "3.2e16"])
        == 0
    )
    assert "Predicted beyond the grid" in capsys.readouterr().out
    assert set(json.loads((tmp_path / "p" / "profiles.json").read_text())["predicted"]["mixit"]) == {"3.2e+16"}


def test_the_bound_from_rows_reads_standards_stable_curves_averaged_over_seeds():
    """A stable run's validation on the way (constant rate, no cooldown) is a standard run of that compute:
    the bound is the least compute at which standard's seed-mean loss reached the variant's, not the
    smallest budget of the grid."""
    stable = {"variant": "standard", "size": "w16", "branch_step": None, "steps": 1000, "flops": 1e12}
    rows = [
        {**stable, "seed": 0, "val_curve": [[250, 2.5e11, 5.0], [500, 5e11, 4.50], [1000, 1e12, 4.2]]},
        {**stable, "seed": 1, "val_curve": [[250, 2.5e11, 5.1], [500, 5e11, 4.62], [1000, 1e12, 4.3]]},
        {"variant": "standard", "size": "w16", "branch_step": 1000, "steps": 1200, "flops": 1.2e12, "seed": 0,
         "final_val_loss": 4.0},  # a branch without a curve: its end
        {"variant": "mixit", "size": "w16", "branch_step": None, "steps": 1000, "flops": 1e12, "seed": 0,
         "val_curve": [[250, 2.5e11, 3.0]]},  # another variant's curve says nothing about standard
    ]  # fmt: skip
    curve = standard_curve(rows, "final_val_loss")
    flops, losses = zip(*sorted(curve))
    assert flops == (2.5e11, 5e11, 1e12, 1.2e12) and losses == pytest.approx([5.05, 4.56, 4.25, 4.0])
    assert reached_by(curve, 4.6, 1e13) == pytest.approx(0.05)  # seed 0 alone (4.50) is not enough: the mean 4.56
    assert reached_by(curve, 4.5, 1e13) == pytest.approx(0.1)
    assert reached_by(curve, 4.1, 1e13) == pytest.approx(0.12)
    assert reached_by(curve, 3.9, 1e13) is None
    # a row's curve is the pooled loss: one validation set's curve has the runs' ends only
    per_set = [{**r, "val_loss/gcide": 3.0} for r in rows]
    assert sorted(standard_curve(per_set, "val_loss/gcide")) == [(1e12, 3.0), (1.2e12, 3.0)]


def test_an_optimum_beyond_the_sizes_is_not_identified_and_leaves_the_laws(tmp_path):
    rows = rows_from_law()
    # the largest budget's sizes all lie below its optimum: its lowest loss is at the widest size run
    rows = [r for r in rows if r["budget"] != BUDGETS[-1]] + [
        {**r, "budget": BUDGETS[-1]} for r in rows_from_law(shift=1 / 40) if r["budget"] == BUDGETS[-1]
    ]
    result = analyse(rows, n_boot=50)
    top = result["profiles"]["standard"][BUDGETS[-1]]
    assert top.vertex is None and top.status.startswith("not identified")
    assert result["laws"]["standard"]["budgets"] == BUDGETS[:-1]
    assert result["noise"]["standard"]["from"].startswith("parabola residuals")
    log = tmp_path / "rows.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["profiles", "--rows", str(log), "--out", str(tmp_path / "out"), "--boot", "20"]) == 0
    md = (tmp_path / "out" / "profiles.md").read_text()
    assert "not identified" in md and (tmp_path / "out" / "isoflop.png").stat().st_size > 0
    assert not (tmp_path / "out" / "multiplier.png").exists()  # standard alone: no multiplier to draw
    assert re.search(r"\| standard \| 4e\+15 \| [\d.]+ vs [\d.]+ \| [+-][\d.]+% \|", md)  # held out: the third budget
    written = json.loads((tmp_path / "out" / "profiles.json").read_text())
    assert written["profiles"]["standard"][f"{BUDGETS[-1]:.6g}"]["N_star"] is None


def test_no_isoflop_rows_is_one_error(tmp_path):
    with pytest.raises(StudyError, match="no IsoFLOP rows"):
        analyse([{"variant": "standard", "final_val_loss": 3.0}])


def test_one_variant_on_two_models_is_not_one_profile():
    """Rows of MixiT with and without its own override (a plain residual) are two models: an error."""
    plain = [{**r, "variant_overrides": ["model.mixit_residual_scale=null"]} for r in rows_from_law("mixit", k=0.25)]
    analyse(rows_from_law() + plain, n_boot=5)
    with pytest.raises(StudyError, match="mixit trained on 2 models"):
        analyse(rows_from_law() + plain + rows_from_law("mixit", k=0.5), n_boot=5)


def test_the_parabola_is_fitted_near_the_minimum_only():
    """A profile that is a parabola near its minimum and rises steeply far from it (as losses do at
    sizes trained on a token or two per parameter): the far points do not move the vertex."""
    x = np.log(2.0 ** np.arange(8))  # the lowest loss at 2^3; five points around it are exact
    loss = 3 + (x - math.log(8)) ** 2 + np.where(x > math.log(33), 5.0, 0.0)
    assert math.exp(vertex(x, loss)[0]) == pytest.approx(8.0)


def test_a_split_grid_says_where_each_size_trained_and_the_device_check_its_difference(tmp_path):
    """Rows without a device are the CPU's; `--device-check` rows are set beside the grid's rows of the same
    run (second device minus first), and a run the grid lacks is left out."""
    rows = rows_from_law()
    for r in rows:
        r["run"] = f"standard-{r['size']}-s0-b{int(r['budget'] / 1e15)}"
        if r["size"] in ("x2", "x3"):
            r["device"] = "cuda"
    again = [{**r, "device": "cuda", "final_val_loss": r["final_val_loss"] + 0.01} for r in rows if r["size"] == "x0"]
    again.append({**again[0], "run": "standard-x9-s0-b1"})  # not in the grid
    result = analyse(rows, n_boot=20, again=again)
    assert result["devices"] == {"standard": {"cpu": ["x-3", "x-2", "x-1", "x0", "x1"], "cuda": ["x2", "x3"]}}
    first = result["profiles"]["standard"][BUDGETS[0]]  # each point knows its device (the figure rings the GPU's)
    assert [d for s, d in zip(first.sizes, first.devices) if d == "cuda"] and all(
        (d == "cuda") == (s in ("x2", "x3")) for s, d in zip(first.sizes, first.devices)
    )
    checks = result["device_check"]
    assert len(checks) == len(BUDGETS) and all(c["difference"] == pytest.approx(0.01) for c in checks)
    assert {tuple(c["devices"]) for c in checks} == {("cpu", "cuda")}
    md = report_markdown(result)
    assert "| standard | cuda | x2, x3 |" in md and "standard: largest |difference| 0.0100 nats over 4 runs" in md
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "empty.jsonl").write_text("")
    args = ["profiles", "--rows", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "p"), "--boot", "5"]
    assert main([*args, "--device-check", str(tmp_path / "empty.jsonl")]) != 0 and not (tmp_path / "p").exists()


def test_a_shift_moves_one_devices_rows_and_their_optima_by_as_much(tmp_path, capsys):
    """--shift VARIANT@DEVICE=NATS: a sensitivity check of a device's possible bias. Shifting every row of
    a profile moves its L* by exactly that, and nothing else; the report says the rows are shifted."""
    rows = rows_from_law() + [{**r, "variant": "mixit", "device": "cuda"} for r in rows_from_law("mixit", k=0.5)]
    for r in rows:
        r["val_curve"] = [[10, r["flops"] / 2, r["final_val_loss"] + 0.3]]
    moved = shift_rows(rows, "mixit@cuda=-0.05")
    assert [r["final_val_loss"] for r in moved if r["variant"] == "standard"] == [
        r["final_val_loss"] for r in rows if r["variant"] == "standard"
    ]
    assert all(
        m["final_val_loss"] == pytest.approx(r["final_val_loss"] - 0.05) and m["val_curve"][0][2] == pytest.approx(r["val_curve"][0][2] - 0.05)
        for m, r in zip(moved, rows) if r["variant"] == "mixit"
    )  # fmt: skip
    before, after = analyse(rows, n_boot=20), analyse(moved, n_boot=20)
    for c in BUDGETS:
        assert after["profiles"]["mixit"][c].vertex[1] == pytest.approx(before["profiles"]["mixit"][c].vertex[1] - 0.05)
        assert after["profiles"]["standard"][c].vertex == before["profiles"]["standard"][c].vertex
    with pytest.raises(StudyError, match="is not VARIANT@DEVICE=NATS"):
        shift_rows(rows, "mixit@cuda=1.2.3")
    with pytest.raises(StudyError, match="no such rows"):
        shift_rows(rows, "standard@cuda=0.1")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["profiles", "--rows", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "p"), "--boot", "5"]
    assert main([*args, "--shift", "mixit=0.1"]) != 0 and not (tmp_path / "p").exists()
    assert capsys.readouterr().err.startswith("error: --shift 'mixit=0.1' is not VARIANT@DEVICE=NATS")
    assert main([*args, "--shift", "mixit@cuda=0.02"]) == 0
    assert (tmp_path / "p" / "profiles.md").read_text().startswith("**Shifted rows** (`--shift mixit@cuda=0.02`)")
