"""Scaling fits recover known exponents from synthetic data; plots are written."""

import numpy as np
import pytest

from common.errors import StudyError
from studies.scaling_fit import JOINT_PARAMS, fit_joint, fit_power_law, fit_variants, held_out_check, plot_fits


def test_recovers_known_law_exactly():
    n = np.geomspace(1e5, 1e9, 8)
    fit = fit_power_law(n, 1.7 + 400.0 * n**-0.34)
    assert abs(fit.alpha - 0.34) < 1e-3 and abs(fit.E - 1.7) < 1e-3 and abs(fit.A / 400.0 - 1) < 1e-2
    assert fit.r2 > 0.9999


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
