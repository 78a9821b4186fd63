"""Scaling-law fits: L(x) = E + A * x^(-alpha), per variant, with uncertainties and plots.

x is a parameter count N or a compute budget C (FLOPs). Fitting happens in the
log-parametrisation (log A) with scipy's curve_fit; the reported uncertainty is the
square root of the covariance diagonal (one standard error per parameter). With several
seeds per point the fit weights each point by its standard error (sigma), so noisy
points count less; with one seed all points weigh the same.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class PowerLawFit:
    E: float
    A: float
    alpha: float
    E_err: float
    A_err: float
    alpha_err: float
    r2: float
    rmse: float
    n_points: int

    def predict(self, x: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * np.power(np.asarray(x, dtype=float), -self.alpha)

    def to_dict(self) -> dict:
        return asdict(self)


def _model(logx: np.ndarray, E: float, logA: float, alpha: float) -> np.ndarray:
    return E + np.exp(logA - alpha * logx)


def fit_power_law(x, loss, sigma=None) -> PowerLawFit:
    """Least-squares fit of L = E + A x^-alpha. Needs >= 3 distinct x values (4+ recommended)."""
    from scipy.optimize import curve_fit  # deferred: heavy

    x, loss = np.asarray(x, dtype=float), np.asarray(loss, dtype=float)
    if len(np.unique(x)) < 3:
        raise ValueError(
            f"a power-law fit needs at least 3 distinct sizes, got {len(np.unique(x))}; "
            "add sizes to the sweep (e.g. --sizes tiny,xs,s,m)"
        )
    if np.any(x <= 0) or not np.all(np.isfinite(loss)):
        raise ValueError("sizes must be positive and losses finite")
    logx = np.log(x)
    if sigma is not None:
        sigma = np.asarray(sigma, dtype=float)
        sigma = np.where(sigma > 0, sigma, np.nan)
        sigma = None if np.all(np.isnan(sigma)) else np.where(np.isnan(sigma), np.nanmean(sigma), sigma)
    best = None
    # A few starting points for E (the irreducible loss): below the smallest observed loss.
    for frac in (0.0, 0.5, 0.9):
        E0 = frac * loss.min()
        slope = np.polyfit(logx, np.log(np.maximum(loss - E0, 1e-9)), 1)
        p0 = (E0, slope[1], max(-slope[0], 1e-3))
        try:
            popt, pcov = curve_fit(
                _model,
                logx,
                loss,
                p0=p0,
                sigma=sigma,
                absolute_sigma=sigma is not None,
                bounds=([0.0, -50.0, 0.0], [loss.min(), 50.0, 5.0]),
                maxfev=20000,
            )
        except (RuntimeError, ValueError):
            continue
        resid = loss - _model(logx, *popt)
        sse = float(np.sum(resid**2))
        if best is None or sse < best[2]:
            best = (popt, pcov, sse)
    if best is None:
        raise RuntimeError("the power-law fit did not converge; check that loss falls with size")
    popt, pcov, sse = best
    err = np.sqrt(np.clip(np.diag(pcov), 0, None)) if np.all(np.isfinite(pcov)) else np.full(3, np.nan)
    E, logA, alpha = (float(v) for v in popt)
    A = math.exp(logA)
    ss_tot = float(np.sum((loss - loss.mean()) ** 2))
    return PowerLawFit(
        E=E,
        A=A,
        alpha=alpha,
        E_err=float(err[0]),
        A_err=float(A * err[1]),
        alpha_err=float(err[2]),
        r2=1.0 - sse / ss_tot if ss_tot > 0 else float("nan"),
        rmse=math.sqrt(sse / len(loss)),
        n_points=len(loss),
    )


def aggregate_seeds(rows: list[dict], x_key: str, y_key: str) -> dict[str, dict[str, np.ndarray]]:
    """Group rows by variant and x: mean, standard deviation and count over seeds."""
    out: dict[str, dict[str, list]] = {}
    for variant in sorted({r["variant"] for r in rows}):
        by_x: dict[float, list[float]] = {}
        for r in rows:
            if r["variant"] == variant and r.get(y_key) is not None and r.get(x_key):
                by_x.setdefault(float(r[x_key]), []).append(float(r[y_key]))
        xs = sorted(by_x)
        out[variant] = {
            "x": np.array(xs),
            "mean": np.array([np.mean(by_x[x]) for x in xs]),
            "std": np.array([np.std(by_x[x], ddof=1) if len(by_x[x]) > 1 else 0.0 for x in xs]),
            "n": np.array([len(by_x[x]) for x in xs]),
        }
    return out


def fit_variants(rows: list[dict], x_key: str, y_key: str) -> dict[str, PowerLawFit | str]:
    """One fit per variant; a variant with too few points gets the reason instead of a fit."""
    fits: dict[str, PowerLawFit | str] = {}
    for variant, agg in aggregate_seeds(rows, x_key, y_key).items():
        try:
            sem = np.where(agg["n"] > 1, agg["std"] / np.sqrt(np.maximum(agg["n"], 1)), 0.0)
            fits[variant] = fit_power_law(agg["x"], agg["mean"], sem if np.any(sem > 0) else None)
        except (ValueError, RuntimeError) as err:
            fits[variant] = str(err)
    return fits


def plot_fits(
    rows: list[dict], fits: dict[str, PowerLawFit | str], x_key: str, y_key: str, out_png: str | Path, xlabel: str
) -> Path:
    """Points (mean +- std over seeds) and fitted curves, one colour per variant, log x axis."""
    import matplotlib  # deferred: heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: heavy

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, (variant, agg) in enumerate(aggregate_seeds(rows, x_key, y_key).items()):
        color = f"C{i}"
        ax.errorbar(agg["x"], agg["mean"], yerr=agg["std"], fmt="o", color=color, capsize=3, label=variant)
        fit = fits.get(variant)
        if isinstance(fit, PowerLawFit) and len(agg["x"]):
            grid = np.geomspace(agg["x"].min() / 1.5, agg["x"].max() * 1.5, 100)
            ax.plot(
                grid,
                fit.predict(grid),
                "-",
                color=color,
                alpha=0.8,
                label=f"{variant}: {fit.E:.2f} + {fit.A:.3g}·x^-{fit.alpha:.2f}",
            )
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(y_key.replace("_", " "))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
