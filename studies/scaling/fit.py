"""Scaling-law fits: L(x) = E + A * x^(-alpha), per variant, with uncertainties and plots; and the
joint law L(N, D) = E + A N^-alpha + B D^-beta (Chinchilla's approach 3) with bootstrap intervals and
a held-out check (fit without the largest size, predict it).

x is a parameter count N or a compute budget C (FLOPs). Fitting happens in the
log-parametrisation (log A) with scipy's curve_fit; the reported uncertainty is the
square root of the covariance diagonal (one standard error per parameter). With several
seeds per point the fit weights each point by its standard error (sigma), so noisy
points count less; with one seed all points weigh the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common.errors import StudyError
from eval.report import new_figure, save_figure


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
    E_max: float = math.inf  # the search's upper bound on E: the lowest loss fitted

    def predict(self, x: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * np.power(np.asarray(x, dtype=float), -self.alpha)

    def to_dict(self) -> dict:
        return {**asdict(self), "not_identified": self.not_identified()}

    def at_bounds(self) -> list[str]:
        """The parameters at a bound of the search (E at 0 or at the lowest loss, alpha at 0 or 5): the fit
        is degenerate, a law of another form."""
        reasons = []
        if self.E <= 1e-3 or self.E >= self.E_max - 1e-3:
            reasons.append(f"E at its bound {'0' if self.E <= 1e-3 else 'the lowest loss'} ({self.E:.3g})")
        if self.alpha <= 1e-3 or self.alpha >= 5 - 1e-3:
            reasons.append(f"alpha at its bound {5 if self.alpha >= 5 - 1e-3 else 0} ({self.alpha:.3g})")
        return reasons

    def not_identified(self) -> list[str]:
        """Why the fit does not determine the law, if it does not (JointFit's rule): a parameter at a bound
        of the search (`at_bounds`), or a 90 % interval (1.645 standard errors either side) reaching 0 or
        spanning more than a decade."""
        reasons = self.at_bounds()
        for k in ("E", "A", "alpha"):
            value, err = getattr(self, k), getattr(self, f"{k}_err")
            low, high = value - 1.645 * err, value + 1.645 * err
            if not np.isfinite(err) or low <= 0 or high / low > 10:
                reasons.append(f"{k}'s interval [{low:.3g}, {high:.3g}] reaches 0 or spans more than a decade")
        return reasons


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
            bounds = ([0.0, -50.0, 0.0], [loss.min(), 50.0, 5.0])
            popt, pcov = curve_fit(
                _model, logx, loss, p0=p0, sigma=sigma, absolute_sigma=sigma is not None, bounds=bounds, maxfev=20000
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
    r2 = 1.0 - sse / ss_tot if ss_tot > 0 else float("nan")
    errors = float(err[0]), float(A * err[1]), float(err[2])  # of E, A (from log A's) and alpha
    return PowerLawFit(
        E, A, alpha, *errors, r2=r2, rmse=math.sqrt(sse / len(loss)), n_points=len(loss), E_max=float(loss.min())
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
    fig, ax = new_figure(figsize=(6.4, 4.4))
    for i, (variant, agg) in enumerate(aggregate_seeds(rows, x_key, y_key).items()):
        color = f"C{i}"
        ax.errorbar(agg["x"], agg["mean"], yerr=agg["std"], fmt="o", color=color, capsize=3, label=variant)
        fit = fits.get(variant)
        if isinstance(fit, PowerLawFit) and len(agg["x"]):
            grid = np.geomspace(agg["x"].min() / 1.5, agg["x"].max() * 1.5, 100)
            label = f"{variant}: {fit.E:.2f} + {fit.A:.3g}·x^-{fit.alpha:.2f}"
            ax.plot(grid, fit.predict(grid), "-", color=color, alpha=0.8, label=label)
    _style(ax, xlabel, y_key.replace("_", " "))
    return save_figure(fig, out_png, dpi=120)


def _style(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


# ---- the joint law L(N, D) = E + A N^-alpha + B D^-beta (Chinchilla's approach 3) ----------------
JOINT_PARAMS = ("E", "A", "alpha", "B", "beta")
EXPONENT_BOUNDS = {"alpha": (0.0, 5.0), "beta": (0.0, 5.0)}  # the search's box (`_minimise`)
HUBER_DELTA = 1e-3  # Chinchilla's: the fit is of log-loss, so residuals are relative errors
MIN_JOINT_POINTS = 6


@dataclass
class JointFit:
    """L(N, D) = E + A N^-alpha + B D^-beta, with bootstrap intervals (parameter -> [low, high])."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    n_points: int
    rmse_log: float  # root mean square of log(predicted / observed)
    intervals: dict[str, list[float]] = field(default_factory=dict)
    samples: list[dict[str, float]] = field(default_factory=list, repr=False)  # the bootstrap refits

    def params(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in JOINT_PARAMS}

    def predict(self, N, D) -> np.ndarray:
        return predict_joint(self.params(), N, D)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "samples"}, "not_identified": self.not_identified()}

    def at_bounds(self) -> list[str]:
        """The parameters at a bound of the search (E at 0, an exponent at 0 or 5): the fit is degenerate."""
        reasons = []
        if self.E <= 1e-3:
            reasons.append(f"E at its bound 0 ({self.E:.2g})")
        for k, (low, high) in EXPONENT_BOUNDS.items():
            value = getattr(self, k)
            if value <= low + 1e-3 or value >= high - 1e-3:
                reasons.append(f"{k} at its bound {high if value >= high - 1e-3 else low:g} ({value:.3g})")
        return reasons

    def not_identified(self) -> list[str]:
        """Why the fit does not determine the law, if it does not: a parameter at a bound of the search
        (`at_bounds`), or a bootstrap interval spanning more than a decade."""
        reasons = self.at_bounds()
        for k, (low, high) in self.intervals.items():
            if low <= 0 or high / low > 10:
                reasons.append(f"{k}'s interval [{low:.3g}, {high:.3g}] spans more than a decade")
        return reasons


def predict_joint(params: dict[str, float], N, D) -> np.ndarray:
    N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
    return params["E"] + params["A"] * N ** -params["alpha"] + params["B"] * D ** -params["beta"]


# Starting points (a, alpha, b, beta, e) besides the linear one: corners of the middle of Chinchilla's
# grid (alpha, beta in 0..2, e in -1..1, a, b in 0..25). With a Huber delta this small many local fits
# stall where they start, so every fit also starts from `_linear_start`.
_GRID = [np.array([5.0, alpha, 5.0, beta, e]) for alpha in (0.25, 1.0) for beta in (0.25, 1.0) for e in (-0.5, 0.5)]
_EXPONENTS = np.linspace(0.05, 1.5, 16)


def _linear_start(N: np.ndarray, D: np.ndarray, L: np.ndarray, exponents: np.ndarray = _EXPONENTS) -> np.ndarray:
    """For fixed exponents the law is linear in (E, A, B): the best non-negative least-squares
    solution over a grid of exponents, as a starting point."""
    from scipy.optimize import nnls  # deferred: heavy

    best, best_err = None, math.inf
    for alpha in exponents:
        for beta in exponents:
            X = np.stack([np.ones_like(N), N**-alpha, D**-beta], axis=1)
            coef, _ = nnls(X, L)
            pred = X @ coef
            if np.any(pred <= 0):
                continue
            err = float(np.sum(np.log(pred / L) ** 2))
            if err < best_err:
                best, best_err = (coef, alpha, beta), err
    (E, A, B), alpha, beta = best
    return np.array([math.log(max(A, 1e-8)), alpha, math.log(max(B, 1e-8)), beta, math.log(max(E, 1e-8))])


def _check_joint_points(N: np.ndarray, D: np.ndarray, L: np.ndarray) -> None:
    if not (len(N) == len(D) == len(L)):
        raise StudyError(f"joint fit: N, D and L differ in length ({len(N)}, {len(D)}, {len(L)})")
    if len(L) < MIN_JOINT_POINTS or len(np.unique(N)) < 2 or len(np.unique(D)) < 2:
        raise StudyError(
            f"the joint fit L(N, D) has 5 parameters and needs at least {MIN_JOINT_POINTS} points over >= 2 sizes "
            f"and >= 2 token budgets; got {len(L)} points, {len(np.unique(N))} sizes, {len(np.unique(D))} budgets. "
            "Fix: more sizes or cooldown branches (more budgets) in the ladder"
        )
    if np.any(N <= 0) or np.any(D <= 0) or np.any(L <= 0) or not np.all(np.isfinite(L)):
        raise StudyError("joint fit: sizes, token counts and losses must be positive and finite")


def _residuals(theta: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray) -> np.ndarray:
    """log L(N, D) - log L with L(N, D) = exp(LSE(a - alpha log N, b - beta log D, e))."""
    a, alpha, b, beta, e = theta
    return np.logaddexp(np.logaddexp(a - alpha * logN, b - beta * logD), e) - logL


def _jacobian(theta: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray) -> np.ndarray:
    """d residual / d theta: the softmax weights of the three terms (times -log N, -log D for the exponents)."""
    a, alpha, b, beta, e = theta
    terms = np.stack([a - alpha * logN, b - beta * logD, np.full_like(logN, e)], axis=1)
    w = np.exp(terms - terms.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.stack([w[:, 0], -w[:, 0] * logN, w[:, 1], -w[:, 1] * logD, w[:, 2]], axis=1)


def _minimise(starts, logN, logD, logL, delta) -> tuple[np.ndarray, float]:
    """The best of a local fit from each start. scipy's least_squares with loss='huber' and
    f_scale=delta minimises exactly sum Huber_delta(residual) (its cost is 0.5 f^2 rho((r/f)^2)),
    by a bounded trust-region method that needs far fewer evaluations than L-BFGS on this objective."""
    from scipy.optimize import least_squares  # deferred: heavy
    from scipy.special import huber  # deferred: heavy

    best_theta, best_value = None, math.inf
    (a_low, a_high), (b_low, b_high) = EXPONENT_BOUNDS.values()
    lower = [-np.inf, a_low, -np.inf, b_low, -np.inf]
    upper = [np.inf, a_high, np.inf, b_high, np.inf]
    for x0 in starts:
        x0, data = np.clip(x0, lower, upper), (logN, logD, logL)
        res = least_squares(
            _residuals, x0, jac=_jacobian, args=data, loss="huber", f_scale=delta, bounds=(lower, upper), method="trf"
        )
        value = float(huber(delta, res.fun).sum())
        if np.isfinite(value) and value < best_value:
            best_theta, best_value = res.x, value
    if best_theta is None:
        raise StudyError(
            "the joint fit did not converge from any starting point. Fix: check that loss falls with N and D"
        )
    return best_theta, best_value


def fit_joint(N, D, L, *, n_boot: int = 200, seed: int = 0, delta: float = HUBER_DELTA, level: float = 0.9) -> JointFit:
    """Chinchilla's approach 3: minimise the Huber loss of log-loss from many starting points
    (L-BFGS-B), then refit `n_boot` bootstrap resamples of the points (from the best fit and a few
    grid starts) for `level` percentile intervals of every parameter."""
    N, D, L = (np.asarray(v, dtype=float) for v in (N, D, L))
    _check_joint_points(N, D, L)
    logN, logD, logL = np.log(N), np.log(D), np.log(L)
    theta, _ = _minimise([_linear_start(N, D, L), *_GRID], logN, logD, logL, delta)
    rmse = float(np.sqrt(np.mean(_residuals(theta, logN, logD, logL) ** 2)))
    fit = JointFit(**_named(theta), n_points=len(L), rmse_log=rmse)
    if n_boot:
        rng = np.random.default_rng(seed)
        samples = []
        for _ in range(n_boot):
            idx = rng.integers(0, len(L), len(L))
            if len(np.unique(N[idx])) < 2 or len(np.unique(D[idx])) < 2:
                continue
            starts = [theta, _linear_start(N[idx], D[idx], L[idx], _EXPONENTS[::2])]
            t, _ = _minimise(starts, logN[idx], logD[idx], logL[idx], delta)
            samples.append(_named(t))
        fit.samples = samples
        tail = 50 * (1 - level)
        for k in JOINT_PARAMS:
            values = np.array([s[k] for s in samples])
            fit.intervals[k] = [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]
    return fit


def parametric_samples(
    fit: JointFit, N, D, n: int, seed: int = 0, delta: float = HUBER_DELTA, level: float = 0.9
) -> list[dict[str, float]]:
    """A parametric bootstrap of `fit`: `n` refits to its own predictions at the points (N, D) with
    Gaussian noise of its residual scale in log loss (`rmse_log`), each from the fit and a coarse linear
    start (as `fit_joint`'s resamples). Unlike resampling points, every draw keeps every size and budget
    (an IsoFLOP grid's frontier needs them all). Sets `fit.intervals` (`level`) from the draws."""
    N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
    logN, logD = np.log(N), np.log(D)
    p = fit.params()
    theta = np.array([math.log(p["A"]), p["alpha"], math.log(p["B"]), p["beta"], math.log(p["E"])])
    mean = np.log(fit.predict(N, D))
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        logL = mean + rng.normal(0.0, fit.rmse_log, len(mean))
        t, _ = _minimise([theta, _linear_start(N, D, np.exp(logL), _EXPONENTS[::2])], logN, logD, logL, delta)
        samples.append(_named(t))
    tail = 50 * (1 - level)
    if samples:
        fit.intervals = {
            k: [float(np.percentile([s[k] for s in samples], q)) for q in (tail, 100 - tail)] for k in JOINT_PARAMS
        }
    return samples


def _named(theta: np.ndarray) -> dict[str, float]:
    a, alpha, b, beta, e = (float(v) for v in theta)
    return {"E": math.exp(e), "A": math.exp(a), "alpha": alpha, "B": math.exp(b), "beta": beta}


def held_out_check(N, D, L, **fit_kwargs) -> dict:
    """Fit without the largest size and predict its losses: the relative error of each of its points
    (predicted / observed - 1), their mean absolute value and the largest."""
    N, D, L = (np.asarray(v, dtype=float) for v in (N, D, L))
    largest = N.max()
    keep = N < largest
    if len(np.unique(N[keep])) < 2:
        raise StudyError(
            f"a held-out check fits without the largest size and needs >= 2 other sizes; got {len(np.unique(N))} "
            "sizes in all. Fix: more sizes in the ladder"
        )
    fit = fit_joint(N[keep], D[keep], L[keep], **{"n_boot": 0, **fit_kwargs})
    predicted = fit.predict(N[~keep], D[~keep])
    rel = predicted / L[~keep] - 1.0
    return {
        "held_out_size": float(largest),
        "points": [
            {"D": float(d), "observed": float(o), "predicted": float(p), "relative_error": float(r)}
            for d, o, p, r in zip(D[~keep], L[~keep], predicted, rel)
        ],
        "mean_abs_relative_error": float(np.mean(np.abs(rel))),
        "max_abs_relative_error": float(np.max(np.abs(rel))),
        "fit_without_largest": fit.to_dict(),
    }


# ---- the compute-optimal frontier in each variant's real FLOPs, and the gap between variants --------
def flops_curve(N, flops_per_token) -> Callable[[np.ndarray], np.ndarray]:
    """Training FLOPs per token as a function of N, through the ladder's own (N, FLOPs per token)
    points: piecewise linear in log-log, the end segments extended. A frozen variant's points already
    leave out the gradients it does not compute, so each variant gets its own curve."""
    from scipy.interpolate import make_interp_spline  # deferred: heavy

    order = np.argsort(np.asarray(N, dtype=float))
    logN = np.log(np.asarray(N, dtype=float)[order])
    logf = np.log(np.asarray(flops_per_token, dtype=float)[order])
    logN, first = np.unique(logN, return_index=True)
    logf = logf[first]
    if len(logN) < 2:
        raise StudyError("a FLOPs-per-token curve needs >= 2 sizes. Fix: more sizes in the ladder")

    line = make_interp_spline(logN, logf, k=1)  # linear pieces; extrapolates the end segments
    return lambda x: np.exp(line(np.log(np.asarray(x, dtype=float))))


def frontier(params: dict[str, float], flops: Callable, C: np.ndarray, N_grid: np.ndarray) -> dict[str, np.ndarray]:
    """For each compute budget C: the N on `N_grid` whose L(N, D = C / FLOPs-per-token(N)) is lowest,
    with that D and L (the compute-optimal allocation under the fitted law)."""
    C, N_grid = np.asarray(C, dtype=float), np.asarray(N_grid, dtype=float)
    D = C[:, None] / flops(N_grid)[None, :]
    L = predict_joint(params, N_grid[None, :], D)
    best = np.argmin(L, axis=1)
    rows = np.arange(len(C))
    return {"C": C, "N": N_grid[best], "D": D[rows, best], "L": L[rows, best]}


def frontier_gap(
    fit: JointFit, base: JointFit, flops: Callable, base_flops: Callable, C, N_grid, base_N_grid, level: float = 0.9
) -> dict[str, np.ndarray]:
    """The frontier loss of `fit` less that of `base` at equal compute, and a `level` band from pairs of
    their bootstrap refits (each variant's points were resampled on their own)."""
    gap = frontier(fit.params(), flops, C, N_grid)["L"] - frontier(base.params(), base_flops, C, base_N_grid)["L"]
    pairs = list(zip(fit.samples, base.samples))
    if not pairs:
        return {"C": np.asarray(C, dtype=float), "gap": gap, "low": gap * np.nan, "high": gap * np.nan}
    draws = np.array(
        [frontier(a, flops, C, N_grid)["L"] - frontier(b, base_flops, C, base_N_grid)["L"] for a, b in pairs]
    )
    tail = 50 * (1 - level)
    low, high = np.percentile(draws, tail, axis=0), np.percentile(draws, 100 - tail, axis=0)
    return {"C": np.asarray(C, dtype=float), "gap": gap, "low": low, "high": high}


def plot_frontier(rows: list[dict], report: dict, y_key: str, out_png: str | Path) -> Path:
    """Left: every cooled run's loss against its training FLOPs and each variant's fitted frontier.
    Right: each variant's frontier gap to standard at equal compute, with its band."""
    fig, (left, right) = new_figure(1, 2, figsize=(11, 4.4))
    for i, (variant, entry) in enumerate(report.items()):
        color = f"C{i}"
        pts = [r for r in rows if r["variant"] == variant and str(r.get("cooled")) == "True" and r.get(y_key)]
        left.plot([float(r["flops"]) for r in pts], [float(r[y_key]) for r in pts], "o", ms=4, color=color, alpha=0.7)
        f = entry["frontier"]
        left.plot(f["C"], f["L"], "-", color=color, label=f"{variant}: frontier of L(N, D)")
        if "gap_to_standard" in entry:
            g = entry["gap_to_standard"]
            right.plot(g["C"], g["gap"], "-", color=color, label=f"{variant} less standard")
            right.fill_between(g["C"], g["low"], g["high"], color=color, alpha=0.2)
    right.axhline(0.0, color="k", lw=0.8)
    xlabel = "training FLOPs (each variant's own: frozen weights' gradients excluded)"
    for ax, ylabel in ((left, y_key.replace("_", " ")), (right, "frontier loss gap to standard")):
        _style(ax, xlabel, ylabel)
    return save_figure(fig, out_png, dpi=120)
