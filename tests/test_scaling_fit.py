"""Scaling fits recover known exponents from synthetic data; plots are written."""

import numpy as np
import pytest

from studies.scaling_fit import fit_power_law, fit_variants, plot_fits


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
