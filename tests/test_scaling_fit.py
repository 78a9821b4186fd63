"""Scaling fits recover known exponents from synthetic data; plots are written."""

import csv
import json

import numpy as np
import pytest

from common.errors import StudyError
from studies.scaling.cli import main
from studies.scaling.fit import (
    JOINT_PARAMS,
    JointFit,
    fit_joint,
    fit_power_law,
    fit_variants,
    flops_curve,
    frontier,
    frontier_gap,
    held_out_check,
    plot_fits,
)


def test_recovers_known_law_exactly():
    n = np.geomspace(1e5, 1e9, 8)
    fit = fit_power_law(n, 1.7 + 400.0 * n**-0.34)
    assert abs(fit.alpha - 0.34) < 1e-3 and abs(fit.E - 1.7) < 1e-3 and abs(fit.A / 400.0 - 1) < 1e-2
    assert fit.r2 > 0.9999 and fit.not_identified() == []


def test_recovers_exponents_with_noise_and_seeds(tmp_path):
    rng = np.random.default_rng(0)
    truth = {"standard": (2.0, 50.0, 0.30), "mixit": (2.6, 30.0, 0.22)}
    rows = []
    for variant, (E, A, alpha) in truth.items():
        for n in np.geomspace(1e4, 1e8, 7):
            for seed in range(3):
                rows.append(
                    {
                        "variant": variant,
                        "params": n,
                        "seed": seed,
                        "val_loss": E + A * n**-alpha + rng.normal(0, 0.005),
                    }
                )
    fits = fit_variants(rows, "params", "val_loss")
    for variant, (E, A, alpha) in truth.items():
        fit = fits[variant]
        assert abs(fit.alpha - alpha) < max(0.03, 3 * fit.alpha_err), (variant, fit)
        assert abs(fit.E - E) < 0.1
        assert fit.alpha_err > 0
    png = plot_fits(rows, fits, "params", "val_loss", tmp_path / "fit.png", "parameters")
    assert png.stat().st_size > 10_000


def test_too_few_points_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 3 distinct sizes"):
        fit_power_law([1e5, 1e6], [3.0, 2.5])
    fits = fit_variants([{"variant": "s", "params": 1e5, "val_loss": 3.0}], "params", "val_loss")
    assert "at least 3" in fits["s"]


def _ladder(truth, noise, seed=0):
    """Points of a ladder like the study's: 6 sizes over 30k-2M, budgets of 2.5-20 tokens per parameter."""
    E, A, alpha, B, beta = truth
    rng = np.random.default_rng(seed)
    N, D = [], []
    for n in np.geomspace(3e4, 2e6, 6):
        for tokens_per_param in (2.5, 5, 10, 20):
            N.append(n)
            D.append(tokens_per_param * n)
    N, D = np.array(N), np.array(D)
    L = (E + A * N**-alpha + B * D**-beta) * np.exp(rng.normal(0, noise, len(N)))
    return N, D, L


def test_joint_fit_recovers_known_law_with_intervals_and_predicts_held_out_size():
    truth = (1.7, 60.0, 0.32, 300.0, 0.30)
    N, D, L = _ladder(truth, noise=0.003)
    fit = fit_joint(N, D, L, n_boot=60)
    for name, value in zip(JOINT_PARAMS, truth):
        got = getattr(fit, name)
        assert got == pytest.approx(value, rel=0.25), (name, fit)
        low, high = fit.intervals[name]
        assert low <= got <= high
    assert fit.alpha == pytest.approx(0.32, abs=0.05) and fit.beta == pytest.approx(0.30, abs=0.05)
    assert fit.rmse_log < 0.006
    check = held_out_check(N, D, L)
    assert check["held_out_size"] == N.max() and len(check["points"]) == 4
    assert check["mean_abs_relative_error"] < 0.01
    # a law that is wrong for the largest size is caught: its losses 5% above the law
    L_bad = np.where(N == N.max(), L * 1.05, L)
    assert held_out_check(N, D, L_bad)["mean_abs_relative_error"] > 0.03


def test_joint_fit_on_too_few_points_is_a_study_error():
    N, D, L = _ladder((1.7, 60.0, 0.32, 300.0, 0.30), noise=0.0)
    with pytest.raises(StudyError, match="at least 6 points"):
        fit_joint(N[:4], D[:4], L[:4])
    one_budget = D == 10 * N
    with pytest.raises(StudyError, match="1 budgets"):
        fit_joint(N[one_budget], np.full(one_budget.sum(), 1e6), L[one_budget])
    two_sizes = N <= np.unique(N)[1]
    with pytest.raises(StudyError, match="held-out check .* needs >= 2 other sizes"):
        held_out_check(N[two_sizes], D[two_sizes], L[two_sizes])


def test_frontier_matches_the_closed_form_allocation():
    """With C = 6 N D the optimum of E + A N^-a + B D^-b is N* = G (C/6)^(b/(a+b)), G = (aA/(bB))^(1/(a+b))."""
    rng = np.random.default_rng()
    E, A, a, B, b = 1.5, rng.uniform(20, 80), rng.uniform(0.25, 0.45), rng.uniform(200, 600), rng.uniform(0.25, 0.45)
    params = dict(E=E, A=A, alpha=a, B=B, beta=b)
    sizes = np.geomspace(1e4, 1e8, 7)
    six_n = flops_curve(sizes, 6 * sizes)
    probe = rng.uniform(1e3, 1e9, 5)  # inside the points and beyond both ends: a power law comes back exactly
    assert six_n(probe) == pytest.approx(6 * probe, rel=1e-9)
    C = np.geomspace(1e12, 1e15, 5)
    grid = np.geomspace(1.0, 1e10, 8000)  # N* lies in [3.7, 1.1e9] over the drawn laws
    got = frontier(params, six_n, C, grid)
    G = (a * A / (b * B)) ** (1 / (a + b))
    assert got["N"] == pytest.approx(G * (C / 6) ** (b / (a + b)), rel=0.01)
    assert got["N"] * got["D"] * 6 == pytest.approx(C)
    assert np.all(np.diff(got["L"]) < 0)


def test_frontier_gap_of_a_shifted_law_is_the_shift_with_a_band():
    base = JointFit(E=1.5, A=50.0, alpha=0.35, B=400.0, beta=0.3, n_points=9, rmse_log=0.0)
    worse = JointFit(E=1.6, A=50.0, alpha=0.35, B=400.0, beta=0.3, n_points=9, rmse_log=0.0)
    base.samples = [{**dict(E=1.5, A=50.0, alpha=0.35, B=400.0, beta=0.3), "E": e} for e in np.linspace(1.45, 1.55, 21)]
    worse.samples = [dict(E=1.6, A=50.0, alpha=0.35, B=400.0, beta=0.3)] * 21
    sizes = np.geomspace(1e4, 1e7, 5)
    curve = flops_curve(sizes, 6 * sizes)
    C = np.geomspace(1e11, 1e14, 4)
    grid = np.geomspace(1e4, 1e7, 300)
    gap = frontier_gap(worse, base, curve, curve, C, grid, grid)
    assert gap["gap"] == pytest.approx(np.full(4, 0.1))
    assert np.all(gap["low"] < 0.1) and np.all(gap["high"] > 0.1) and np.all(gap["low"] > 0.04)
    assert "samples" not in base.to_dict()


def test_fit_of_a_ladder_reports_frontier_gaps_and_same_shape_gaps(tmp_path):
    """`fit` on a ladder's rows drawn from known laws: mixit's law is standard's plus 0.08 with 15% fewer
    FLOPs per token, so its frontier gap at equal compute is below 0.08 and the same-shape gap is 0.08."""
    rng = np.random.default_rng()
    fields = ["run", "variant", "size", "seed", "non_embedding_params", "tokens", "flops", "final_val_loss"]
    fields += ["best_val_loss", "params", "trainable_params", "cooled", "branch_step"]
    rows = []
    for size, n in (("a", 3e4), ("b", 1e5), ("c", 3e5), ("d", 1e6)):
        for budget in (2.5, 5, 10, 20):
            for variant, shift, cost in (("standard", 0.0, 1.0), ("mixit", 0.08, 0.85)):
                tokens = budget * n
                loss = 1.5 + shift + 30 * n**-0.33 + 60 * tokens**-0.3
                loss *= 1 + 0.0002 * rng.standard_normal()
                rows.append(
                    dict(run=f"{variant}-{size}-s0-b{int(budget)}", variant=variant, size=size, seed=0)
                    | dict(non_embedding_params=n, tokens=tokens, flops=6 * n * tokens * cost, final_val_loss=loss)
                    | dict(best_val_loss=loss, params=n, trainable_params=n, cooled=True, branch_step=int(budget))
                )
    out = tmp_path / "ladder"
    out.mkdir()
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    assert main(["fit", "--out", str(out), "--boot", "20"]) == 0
    report = json.loads((out / "fits.json").read_text())
    gap = report["frontier"]["mixit"]["gap_to_standard"]
    # cheaper FLOPs buy back part of the shift, most where compute is scarce (more tokens per FLOP)
    assert all(g < 0.08 for g in gap["gap"]) and gap["gap"][0] < gap["gap"][-1]
    assert all(lo <= g <= hi for lo, g, hi in zip(gap["low"], gap["gap"], gap["high"]))
    md = (out / "fits.md").read_text()
    assert "| a | 75,000 |" in md and "+0.080" in md and "0.850" in md
    assert "30,000 /" in md and "(edge)" in md  # the smallest budgets' optimum lies at the smallest size: said so
    assert (out / "gap_vs_flops.png").stat().st_size > 10_000


def test_a_fit_at_a_bound_or_with_a_wide_interval_says_it_is_not_identified():
    """The joint fit reports what it cannot determine instead of quoting it: E at 0, an exponent at the
    search's bound, an interval spanning more than a decade; a well-determined law has no reason."""
    N, D, L = _ladder((1.7, 60.0, 0.32, 300.0, 0.30), noise=0.003)
    assert fit_joint(N, D, L, n_boot=30).not_identified() == []
    law = JointFit(E=0.0, A=5.0, alpha=5.0, B=400.0, beta=0.3, n_points=9, rmse_log=0.0)
    law.intervals = {"B": [10.0, 4000.0], "beta": [0.2, 0.4]}
    reasons = law.not_identified()
    assert len(reasons) == 3 and reasons[0].startswith("E at its bound 0") and "alpha at its bound 5" in reasons[1]
    assert "B's interval [10, 4e+03] spans more than a decade" in reasons[2]
    assert law.to_dict()["not_identified"] == reasons
    # the one-variable fits by the same rule: a flat loss pins E to the lowest loss and alpha is not determined
    n = np.geomspace(1e4, 1e6, 5)
    flat = fit_power_law(n, 4.0 + 0.01 * np.random.default_rng(0).normal(size=5))
    why = flat.not_identified()
    assert why and any("interval" in w for w in why) and flat.to_dict()["not_identified"] == why
