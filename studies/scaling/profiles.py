"""What the IsoFLOP rows say: each profile's loss-optimal size, the power laws through the optima, each
variant's compute multiplier against standard, a held-out budget, and paired gaps.

- A profile (variant, budget) is a parabola in log N through its points near the minimum (the size with
  the lowest mean loss and two on either side; every seed a point); its vertex is N* and L*, D* the
  tokens there (interpolated in log N). A lowest loss at an end of the sizes, a vertex outside them, or
  a parabola that opens downward is "not identified" and kept out of every law.
- Intervals are a parametric bootstrap: the fitted parabola plus Gaussian noise of the seeds' pooled
  standard deviation (the variant's sizes run at >= 2 seeds; without such, the fit residuals', said so).
  Draw j of every profile is one joint draw, so laws, multipliers and trends carry the intervals.
- The laws are straight lines in log-log through the identified optima: N* ~ C^a, D* ~ C^b, L* ~ C^c
  (no irreducible term: four budgets do not determine one).
- The compute multiplier of a variant at budget C: the compute standard's L*(C) law needs to reach the
  variant's L*, over C (each variant's own FLOPs); beyond standard's measured optima it is an
  extrapolation and flagged, and bounded from the rows alone: the least compute at which a standard run
  (a stable run's validation on the way, or a branch's end) reached that loss. Its trend is the slope of
  log10(multiplier) per decade of C.
- Held out: the laws refitted without the largest budget predict its L* and multiplier.
- A grid split across machines says where each size trained (a row's `device`; rows without one are
  the CPU's), and a device check (the same runs trained again on the other device) gives the loss the
  device alone moves, to set beside the noise per run.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import StudyError
from eval.report import markdown_table

LEVEL = 0.95
HALF_WINDOW = 2  # a profile's parabola: the lowest size and two on either side
STANDARD = "standard"
POOLED = "final_val_loss"  # the loss over every validation set's tokens, which `val_curve` records too


@dataclass
class Profile:
    variant: str
    budget: float
    logN: np.ndarray
    loss: np.ndarray
    logD: np.ndarray
    sizes: list[str]
    seeds: list[int]
    devices: list[str] = field(default_factory=list)  # where each point trained (a row's `device`, else cpu)
    status: str = "identified"
    vertex: tuple[float, float] | None = None  # (log N*, L*)
    draws: np.ndarray = field(default_factory=lambda: np.empty((0, 2)))  # (log N*, L*) per bootstrap draw

    def log_tokens_at(self, logN: float) -> float:
        order = np.argsort(self.logN)
        return float(np.interp(logN, self.logN[order], self.logD[order]))


def local_fit(logN: np.ndarray, loss: np.ndarray, half: int = HALF_WINDOW) -> tuple[np.ndarray, np.ndarray] | None:
    """(the points used, the parabola's coefficients) through the size with the lowest mean loss and
    up to `half` sizes on either side: a profile is a parabola only near its minimum, and far sizes
    would bend the vertex toward them. None when the lowest size is an end of the sizes run (the
    optimum may lie beyond it)."""
    sizes = np.unique(logN)
    means = np.array([loss[logN == x].mean() for x in sizes])
    low = int(np.argmin(means))
    if low in (0, len(sizes) - 1):
        return None
    keep = np.isin(logN, sizes[max(0, low - half) : low + half + 1])
    return keep, np.polyfit(logN[keep], loss[keep], 2)


def vertex(logN: np.ndarray, loss: np.ndarray, half: int = HALF_WINDOW) -> tuple[float, float] | None:
    """(log N*, L*) of the local parabola, or None when the lowest loss is at an end of the sizes, the
    parabola opens downward or its vertex lies outside the sizes it was fitted to."""
    fit = local_fit(logN, loss, half)
    if fit is None:
        return None
    keep, (a, b, c) = fit
    if a <= 0:
        return None
    x = -b / (2 * a)
    if not logN[keep].min() <= x <= logN[keep].max():
        return None
    return float(x), float(c - b * b / (4 * a))


def device_of(row: dict[str, Any]) -> str:
    """Where a row's run trained: its `device`; rows written before rows named one are the CPU's."""
    return row.get("device", "cpu")


def profiles_from_rows(rows: list[dict[str, Any]], metric: str = "final_val_loss") -> dict[str, dict[float, Profile]]:
    """{variant: {budget: Profile}} from the rows of cooled branches that carry an IsoFLOP budget; a
    variant trained on two models (its rows' `variant_overrides` differ) is an error, not one profile."""
    points: dict[tuple[str, float], list[dict]] = defaultdict(list)
    models: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for r in rows:
        if r.get("budget") and r.get("cooled") and isinstance(r.get(metric), (int, float)):
            points[(r["variant"], float(r["budget"]))].append(r)
            models[r["variant"]].add(tuple(r.get("variant_overrides", [])))
    for variant, seen in models.items():
        if len(seen) > 1:
            raise StudyError(
                f"the rows hold {variant} trained on {len(seen)} models (variant_overrides {sorted(seen)}). "
                "Fix: one --rows file per model"
            )
    out: dict[str, dict[float, Profile]] = defaultdict(dict)
    for (variant, budget), pts in sorted(points.items()):
        out[variant][budget] = Profile(
            variant,
            budget,
            np.log([float(p["non_embedding_params"]) for p in pts]),
            np.array([float(p[metric]) for p in pts]),
            np.log([float(p["tokens"]) for p in pts]),
            [p["size"] for p in pts],
            [int(p["seed"]) for p in pts],
            [device_of(p) for p in pts],
        )
    return dict(out)


def seed_noise(profiles: dict[float, Profile], half: int = HALF_WINDOW) -> tuple[float, str]:
    """The pooled standard deviation of a variant's losses over seeds at one (budget, size); the fits'
    residual one where no size has two seeds."""
    ss, dof = 0.0, 0
    for p in profiles.values():
        for size in set(p.sizes):
            values = p.loss[[s == size for s in p.sizes]]
            if len(values) > 1:
                ss += float(np.sum((values - values.mean()) ** 2))
                dof += len(values) - 1
    if dof:
        return math.sqrt(ss / dof), f"seeds (pooled over {dof} degrees of freedom)"
    for p in profiles.values():
        fit = local_fit(p.logN, p.loss, half)
        if fit is not None and fit[0].sum() > 3:
            keep, coef = fit
            ss += float(np.sum((p.loss[keep] - np.polyval(coef, p.logN[keep])) ** 2))
            dof += int(keep.sum()) - 3
    if not dof:
        return math.nan, "none yet (no size has 2 seeds and no profile more than 3 points): no intervals"
    return math.sqrt(ss / dof), f"parabola residuals ({dof} degrees of freedom; no size has 2 seeds yet)"


def fit_profiles(
    profiles: dict[float, Profile], sigma: float, n_boot: int, rng: np.random.Generator, half: int = HALF_WINDOW
) -> None:
    """Each profile's vertex and its bootstrap draws (NaN where a draw has no vertex inside the sizes);
    `half`: the sizes on either side of the lowest that its parabola takes."""
    for p in profiles.values():
        if len(set(p.sizes)) < 3:
            p.status = f"not identified: {len(set(p.sizes))} sizes (a parabola needs 3)"
            continue
        p.vertex = vertex(p.logN, p.loss, half)
        if p.vertex is None:
            p.status = "not identified: the lowest loss is at an edge of the sizes run (or the profile is not convex)"
            continue
        if not math.isfinite(sigma):
            continue
        keep, coef = local_fit(p.logN, p.loss, half)
        logN, fitted = p.logN[keep], np.polyval(coef, p.logN[keep])
        draws = [vertex(logN, fitted + rng.normal(0, sigma, len(fitted)), half) for _ in range(n_boot)]
        p.draws = np.array([d if d is not None else (np.nan, np.nan) for d in draws])
        edge = float(np.mean(np.isnan(p.draws[:, 0])))
        if edge > 1 - LEVEL:
            p.status = f"identified; {edge:.0%} of the draws put the vertex at an edge (the interval reaches it)"


def interval(values: np.ndarray) -> tuple[float, float]:
    v = values[np.isfinite(values)]
    if not len(v):
        return (math.nan, math.nan)
    tail = 50 * (1 - LEVEL)
    return float(np.percentile(v, tail)), float(np.percentile(v, 100 - tail))


def line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; NaN with fewer than 2 finite points."""
    ok = np.isfinite(y)
    if ok.sum() < 2:
        return math.nan, math.nan
    slope, intercept = np.polyfit(x[ok], y[ok], 1)
    return float(intercept), float(slope)


def laws(profiles: dict[float, Profile], budgets: list[float] | None = None) -> dict[str, Any]:
    """N* ~ C^a, D* ~ C^b, L* ~ C^c through the identified optima (of `budgets`, default all), each with
    its bootstrap interval, and the line of log L* against log C (the multiplier's map) per draw."""
    ids = [p for c, p in sorted(profiles.items()) if p.vertex is not None and (budgets is None or c in budgets)]
    if len(ids) < 2:
        return {"budgets": [p.budget for p in ids], "error": f"{len(ids)} identified profile(s); a law needs 2"}
    logC = np.log([p.budget for p in ids])
    est = {
        "N": np.array([p.vertex[0] for p in ids]),
        "D": np.array([p.log_tokens_at(p.vertex[0]) for p in ids]),
        "L": np.log([p.vertex[1] for p in ids]),
    }
    n_boot = min(len(p.draws) for p in ids)
    boot = {
        "N": np.array([p.draws[:n_boot, 0] for p in ids]).T,
        "D": np.array([[p.log_tokens_at(x) if np.isfinite(x) else np.nan for x in p.draws[:n_boot, 0]] for p in ids]).T,
        "L": np.log(np.array([p.draws[:n_boot, 1] for p in ids]).T),
    }
    out: dict[str, Any] = {"budgets": [p.budget for p in ids]}
    for k in est:
        intercept, slope = line(logC, est[k])
        draws = np.array([line(logC, row) for row in boot[k]]) if n_boot else np.empty((0, 2))
        out[k] = {"intercept": intercept, "exponent": slope, "interval": interval(draws[:, 1]) if n_boot else None}
        out[k]["draws"] = draws
    return out


def multiplier(standard_law: dict[str, Any], loss: float, budget: float) -> float:
    """C_standard(loss) / budget on standard's line log L* = i + s log C."""
    i, s = standard_law["intercept"], standard_law["exponent"]
    return math.exp((math.log(loss) - i) / s) / budget


def standard_curve(rows: list[dict[str, Any]], metric: str) -> list[tuple[float, float]]:
    """(FLOPs, loss) at every validation of standard's runs: each stable run's curve (constant rate, no
    cooldown) and each branch's end, the mean over seeds at the same (size, branch, step). A row's
    `val_curve` holds the pooled validation loss, so another metric (one validation set's) has the
    branches' ends only."""
    points: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r.get("variant") != STANDARD:
            continue
        curve = (r.get("val_curve") if metric == POOLED else None) or (
            [[r["steps"], r["flops"], r[metric]]] if isinstance(r.get(metric), (int, float)) else []
        )
        for step, flops, loss in curve:
            points[(r["size"], r.get("branch_step"), step)].append((float(flops), float(loss)))
    return [(pts[0][0], float(np.mean([v for _, v in pts]))) for pts in points.values()]


def reached_by(curve: list[tuple[float, float]], loss: float, budget: float) -> float | None:
    """The multiplier's bound from rows, law-free: the least compute at which a standard run (a branch's
    end or a stable run's validation on the way) had a loss at or below `loss`, over `budget`: standard
    needs at most that; None if no run reached it."""
    reached = [flops for flops, v in curve if v <= loss]
    return min(reached) / budget if reached else None


def compute_multipliers(
    fits: dict[str, dict[float, Profile]], law: dict[str, dict], curve: list[tuple[float, float]]
) -> dict[str, Any]:
    """Per variant and budget: the multiplier with its interval (draw j of the variant's L* through draw j
    of standard's law), whether it extrapolates standard's law and, above standard's measured optima, the
    bound from `curve` (standard_curve); the trend per decade of C."""
    if STANDARD not in law or "error" in law[STANDARD]:
        return {}
    std = law[STANDARD]["L"]

    def by_draw(j: int, loss: float) -> float:
        i, s = std["draws"][j]
        return math.exp((math.log(loss) - i) / s) if np.isfinite(loss) and np.isfinite(s) else np.nan

    return invert_multipliers(
        fits, lambda loss: multiplier(std, loss, 1.0), by_draw, len(std["draws"]), curve, extrapolates=True
    )


def invert_multipliers(
    fits: dict[str, dict[float, Profile]],
    compute_at: Callable[[float], float],
    compute_at_draw: Callable[[int, float], float],
    n_draws: int,
    curve: list[tuple[float, float]],
    extrapolates: bool,
) -> dict[str, Any]:
    """The multipliers of every variant through one map of standard's compute to reach a loss
    (`compute_at`; `compute_at_draw(j, loss)` its bootstrap draw j, paired with each variant's draw j; NaN
    where a map has no value). A map that `extrapolates` gives a value beyond standard's measured optima,
    flagged; one that does not leaves the multiplier out there ("outside"). Above those optima the bound
    from `curve` (standard_curve) stands beside it. The trend: log10(multiplier) per decade of C through
    the budgets with a multiplier."""
    measured = [p.vertex[1] for p in fits[STANDARD].values() if p.vertex is not None]
    out: dict[str, Any] = {}
    for variant, profiles in fits.items():
        if variant == STANDARD:
            continue
        per_budget, log10C, central, draws = {}, [], [], []
        for c, p in sorted(profiles.items()):
            if p.vertex is None:
                continue
            inside = min(measured) <= p.vertex[1] <= max(measured)
            m = compute_at(p.vertex[1]) / c if inside or extrapolates else math.nan
            n = min(len(p.draws), n_draws)
            md = np.array([compute_at_draw(j, p.draws[j, 1]) / c for j in range(n)]) if math.isfinite(m) else []
            per_budget[c] = {
                "multiplier": m,
                "interval": interval(np.asarray(md, dtype=float)),
                "extrapolated": not inside,
            }
            if p.vertex[1] > max(measured):
                per_budget[c]["at_most"] = reached_by(curve, p.vertex[1], c)
            if math.isfinite(m):
                log10C.append(math.log10(c))
                central.append(math.log10(m))
                draws.append(np.log10(md) if len(md) else np.full(0, np.nan))
        trend = None
        if len(log10C) >= 2:
            x = np.array(log10C)
            slope = line(x, np.array(central))[1]
            slopes = np.array([line(x, np.array(col))[1] for col in np.array(draws).T])
            lo, hi = interval(slopes)
            known = math.isfinite(lo) and math.isfinite(hi)
            trend = {"per_decade": slope, "interval": (lo, hi), "moves": bool(lo > 0 or hi < 0) if known else None}
        out[variant] = {"per_budget": per_budget, "trend": trend}
    return out


def held_out(fits: dict[str, dict[float, Profile]]) -> dict[str, Any]:
    """The laws without the largest budget: predicted L* there (relative error against the measured
    vertex) and, for the variants, the multiplier predicted from both refitted lines."""
    out: dict[str, Any] = {}
    std_fit = None
    for variant in sorted(fits, key=lambda v: v != STANDARD):
        ids = sorted(c for c, p in fits[variant].items() if p.vertex is not None)
        if len(ids) < 3:
            out[variant] = {"error": f"{len(ids)} identified budgets; holding one out needs 3"}
            continue
        fitted = laws(fits[variant], ids[:-1])["L"]
        top = ids[-1]
        predicted = math.exp(fitted["intercept"] + fitted["exponent"] * math.log(top))
        measured = fits[variant][top].vertex[1]
        entry = {
            "budget": top,
            "predicted": predicted,
            "measured": measured,
            "relative_error": predicted / measured - 1,
        }
        if variant == STANDARD:
            std_fit = fitted
        elif std_fit is not None:
            entry["multiplier_predicted"] = multiplier(std_fit, predicted, top)
        out[variant] = entry
    return out


def predictions(law: dict[str, dict], budgets: list[float], measured: list[float] = ()) -> dict[str, Any]:
    """Each variant's L* and N* at budgets beyond the grid, read off its laws through every identified optimum
    (interval: the laws' bootstrap draws), and the variants' multipliers there (draw j of a variant's line
    through draw j of standard's; `extrapolated` where the predicted L* lies outside standard's `measured`
    optima): what a larger budget is predicted to measure, written before it runs."""
    out: dict[str, Any] = {}
    std = law.get(STANDARD, {}).get("L")
    for variant, fitted in law.items():
        if "error" in fitted:
            out[variant] = {"error": fitted["error"]}
            continue
        per: dict[float, dict[str, Any]] = {}
        for c in budgets:
            at = {k: np.exp(fitted[k]["draws"] @ [1.0, math.log(c)]) for k in ("L", "N")}
            e: dict[str, Any] = {}
            for k in ("L", "N"):
                e[f"{k}_star"] = math.exp(fitted[k]["intercept"] + fitted[k]["exponent"] * math.log(c))
                e[f"{k}_interval"] = interval(at[k])
            if variant != STANDARD and std is not None:
                n = min(len(at["L"]), len(std["draws"]))
                i, s = std["draws"][:n].T
                e["multiplier"] = multiplier(std, e["L_star"], c)
                e["multiplier_interval"] = interval(np.exp((np.log(at["L"][:n]) - i) / s) / c)
                e["extrapolated"] = not (measured and min(measured) <= e["L_star"] <= max(measured))
            per[c] = e
        out[variant] = per
    return out


def paired_gaps(rows: list[dict[str, Any]], metric: str, rng: np.random.Generator, n_boot: int) -> list[dict]:
    """Variant minus standard at the same (budget, size, seed), so the same data order: the mean over
    seeds and, with >= 2 seeds, a bootstrap interval over them."""
    by_key: dict[tuple, dict[str, float]] = defaultdict(dict)
    width: dict[str, float] = {}
    for r in rows:
        if r.get("budget") and r.get("cooled") and isinstance(r.get(metric), (int, float)):
            by_key[(float(r["budget"]), r["size"], int(r["seed"]))][r["variant"]] = float(r[metric])
            width.setdefault(r["size"], float(r["non_embedding_params"]))
    gaps: dict[tuple, list[float]] = defaultdict(list)
    for (budget, size, _), losses in by_key.items():
        for variant, loss in losses.items():
            if variant != STANDARD and STANDARD in losses:
                gaps[(variant, budget, size)].append(loss - losses[STANDARD])
    out = []
    for (variant, budget, size), d in sorted(gaps.items(), key=lambda kv: (kv[0][0], kv[0][1], width[kv[0][2]])):
        d = np.array(d)
        boot = np.array([rng.choice(d, len(d)).mean() for _ in range(n_boot)]) if len(d) > 1 else np.array([])
        out.append(
            {"variant": variant, "budget": budget, "size": size, "seeds": len(d), "gap": float(d.mean()),
             "interval": interval(boot) if len(d) > 1 else None}
        )  # fmt: skip
    return out


def analyse(
    rows: list[dict[str, Any]],
    metric: str = POOLED,
    n_boot: int = 1000,
    seed: int = 0,
    again: list[dict[str, Any]] | None = None,
    half: int = HALF_WINDOW,
    predict_at: list[float] = (),
) -> dict:
    """Everything above from the rows (and `again`: a device check's rows; `half`: each parabola's sizes
    on either side of the lowest; `predict_at`: budgets beyond the grid to predict); JSON-ready but for the
    bootstrap arrays (dropped by `to_json`)."""
    rng = np.random.default_rng(seed)
    fits = profiles_from_rows(rows, metric)
    if not fits:
        raise StudyError("no IsoFLOP rows (cooled branches with a budget). Fix: run `studies.scaling isoflop` first")
    noise, law = {}, {}
    for variant, profiles in fits.items():
        sigma, source = seed_noise(profiles, half)
        noise[variant] = {"sigma": sigma, "from": source}
        fit_profiles(profiles, sigma, n_boot, rng, half)
        law[variant] = laws(profiles)
    return {
        "profiles": fits,
        "noise": noise,
        "laws": law,
        "multipliers": compute_multipliers(
            fits, {v: law[v] for v in law if "L" in law[v]}, standard_curve(rows, metric)
        ),
        "held_out": held_out(fits),
        "predicted": predictions(
            law, sorted(predict_at), [p.vertex[1] for p in fits.get(STANDARD, {}).values() if p.vertex is not None]
        ),
        "paired_gaps": paired_gaps(rows, metric, rng, n_boot),
        "devices": devices(fits),
        "device_check": device_check(rows, again or [], metric),
    }


def shift_rows(rows: list[dict[str, Any]], spec: str, metric: str = "final_val_loss") -> list[dict[str, Any]]:
    """`spec` VARIANT@DEVICE=NATS,...: the rows with every run of VARIANT trained on DEVICE moved by NATS
    (its final loss and each validation on the way): how far a verdict stands from a device's possible
    bias, the device check's size, without training anything."""
    moves: dict[tuple[str, str], float] = {}
    for item in spec.split(","):
        m = re.fullmatch(r"([\w-]+)@(\w+)=([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)", item.strip())
        if m is None:
            raise StudyError(f"--shift {item!r} is not VARIANT@DEVICE=NATS. Fix: e.g. --shift standard@cuda=-0.075")
        moves[(m[1], m[2])] = float(m[3])
    if missing := [f"{v}@{d}" for v, d in moves if not any(r["variant"] == v and device_of(r) == d for r in rows)]:
        raise StudyError(f"--shift {','.join(missing)}: no such rows. Fix: a variant and a device the rows name")
    out = []
    for r in rows:
        d = moves.get((r["variant"], device_of(r)))
        if d is not None and r.get(metric) is not None:
            r = {**r, metric: r[metric] + d, "val_curve": [[s, c, v + d] for s, c, v in r.get("val_curve", [])]}
        out.append(r)
    return out


def devices(fits: dict[str, dict[float, Profile]]) -> dict[str, dict[str, list[str]]]:
    """{variant: {device: the sizes of its profiles' points that trained there, smallest first}}."""
    where: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for variant, profiles in fits.items():
        for p in profiles.values():
            for size, device, logN in zip(p.sizes, p.devices, p.logN):
                where[variant][device][size] = logN
    return {v: {d: sorted(s, key=s.get) for d, s in sorted(ds.items())} for v, ds in sorted(where.items())}


def device_check(rows: list[dict[str, Any]], again: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The runs of `again` (trained again on another device) beside their grid rows: the loss the device
    alone moves (same seed, data order, initial weights and MixiT matrix; only the rounding differs)."""
    grid = {r["run"]: r for r in rows if "run" in r}
    out = []
    for r in again:
        first = grid.get(r["run"])
        if first is None or first.get(metric) is None or r.get(metric) is None:
            continue
        out.append(
            {"run": r["run"], "variant": r["variant"], "budget": r.get("budget"), "devices": [device_of(first),
             device_of(r)], "losses": [first[metric], r[metric]], "difference": r[metric] - first[metric]}
        )  # fmt: skip
    return out


def _fmt_interval(lo_hi, fmt: str) -> str:
    if not lo_hi or any(not math.isfinite(v) for v in lo_hi):
        return "—"
    return f"[{lo_hi[0]:{fmt}}, {lo_hi[1]:{fmt}}]"


def report_markdown(result: dict) -> str:
    """The tables of the result: profiles, laws, multipliers, held-out budget, paired gaps."""
    prof = []
    for variant, profiles in result["profiles"].items():
        for c, p in sorted(profiles.items()):
            if p.vertex is None:
                prof.append([variant, f"{c:.3g}", len(p.loss), "—", "—", "—", p.status])
                continue
            n_iv = tuple(math.exp(v) for v in interval(p.draws[:, 0]))
            prof.append(
                [variant, f"{c:.3g}", len(p.loss), f"{math.exp(p.vertex[0]):,.0f} {_fmt_interval(n_iv, ',.0f')}",
                 f"{math.exp(p.log_tokens_at(p.vertex[0])):,.0f}",
                 f"{p.vertex[1]:.3f} {_fmt_interval(interval(p.draws[:, 1]), '.3f')}", p.status]
            )  # fmt: skip
    md = [f"### IsoFLOP profiles ({LEVEL:.0%} bootstrap intervals)", ""]
    md.append(markdown_table(["variant", "budget (FLOPs)", "runs", "N*", "D* (tokens)", "L*", "status"], prof))
    md += ["", "Noise per run (the bootstrap's): " + "; ".join(
        f"{v} {n['sigma']:.3f} from {n['from']}" for v, n in result["noise"].items()), ""]  # fmt: skip
    law_rows = []
    for variant, law in result["laws"].items():
        if "error" in law:
            law_rows.append([variant, "—", "—", "—", law["error"]])
            continue
        cells = [f"{law[k]['exponent']:+.3f} {_fmt_interval(law[k]['interval'], '+.3f')}" for k in ("N", "D", "L")]
        law_rows.append([variant, *cells, ", ".join(f"{c:.3g}" for c in law["budgets"])])
    md += ["### Power laws through the optima: N* ~ C^a, D* ~ C^b, L* ~ C^c", ""]
    md += [markdown_table(["variant", "a (N*)", "b (D*)", "c (L*)", "budgets"], law_rows), ""]
    mult_rows = []
    for variant, m in result["multipliers"].items():
        for c, e in sorted(m["per_budget"].items()):
            flag = " (extrapolated)" if e["extrapolated"] else ""
            if "at_most" in e:
                bound = e["at_most"]
                flag += f"; from rows: at most {bound:.3g}" if bound is not None else "; no standard run reaches it"
            mult_rows.append(
                [variant, f"{c:.3g}", f"{e['multiplier']:.3g} {_fmt_interval(e['interval'], '.3g')}{flag}"]
            )
        if t := m["trend"]:
            moves = {True: "moves", False: "does not move beyond its interval", None: "no interval yet"}[t["moves"]]
            mult_rows.append(
                [variant, "per decade of C", f"{t['per_decade']:+.3f} {_fmt_interval(t['interval'], '+.3f')} ({moves})"]
            )
    md += ["### Compute multiplier: standard's compute to reach the variant's L*, over the variant's", ""]
    md += [
        markdown_table(["variant", "budget (FLOPs)", "multiplier (log10 slope per decade)"], mult_rows)
        if mult_rows
        else "(none yet)",
        "",
    ]
    held = []
    for variant, h in result["held_out"].items():
        if "error" in h:
            held.append([variant, "—", "—", "—", h["error"]])
        else:
            m = f"{h['multiplier_predicted']:.3g}" if "multiplier_predicted" in h else "—"
            held.append(
                [
                    variant,
                    f"{h['budget']:.3g}",
                    f"{h['predicted']:.3f} vs {h['measured']:.3f}",
                    f"{h['relative_error']:+.2%}",
                    m,
                ]
            )
    md += ["### Held out: the largest budget predicted from the others", ""]
    md += [markdown_table(["variant", "budget", "L* predicted vs measured", "error", "multiplier predicted"], held), ""]
    if any("error" not in e and e for e in result["predicted"].values()):
        pred = [
            [variant, f"{c:.3g}", f"{e['L_star']:.3f} {_fmt_interval(e['L_interval'], '.3f')}",
             f"{e['N_star']:.3g} {_fmt_interval(e['N_interval'], '.3g')}",
             f"{e['multiplier']:.3g} {_fmt_interval(e['multiplier_interval'], '.3g')}"
             + (" (extrapolated)" if e["extrapolated"] else "") if "multiplier" in e else "—"]
            for variant, per in result["predicted"].items() if "error" not in per for c, e in per.items()
        ]  # fmt: skip
        md += ["### Predicted beyond the grid: each law through every identified optimum, read at a larger budget", ""]
        md += [markdown_table(["variant", "budget", "L*", "N* (non-embedding)", "multiplier"], pred), ""]
    gaps = [
        [
            g["variant"],
            f"{g['budget']:.3g}",
            g["size"],
            g["seeds"],
            f"{g['gap']:+.3f} {_fmt_interval(g['interval'], '+.3f')}",
        ]
        for g in result["paired_gaps"]
    ]
    md += ["### Paired gaps to standard (same budget, size, seed and data order)", ""]
    md += [markdown_table(["variant", "budget", "size", "seeds", "gap (nats)"], gaps) if gaps else "(none yet)", ""]
    where = [[v, d, ", ".join(sizes)] for v, ds in result["devices"].items() for d, sizes in ds.items()]
    md += ["### Where the sizes trained", "", markdown_table(["variant", "device", "sizes"], where), ""]
    if checks := result["device_check"]:
        md += ["### The device check: the same runs trained again on the other device", ""]
        md += [
            markdown_table(
                ["run", "budget", "devices", "losses", "difference"],
                [[c["run"], f"{c['budget']:.3g}" if c["budget"] else "stable run", " -> ".join(c["devices"]),
                  " -> ".join(f"{x:.4f}" for x in c["losses"]), f"{c['difference']:+.4f}"] for c in checks],
            ),
            "",
        ]  # fmt: skip
        for v in sorted({c["variant"] for c in checks}):
            diffs = [abs(c["difference"]) for c in checks if c["variant"] == v]
            noise = result["noise"].get(v, {}).get("sigma", float("nan"))
            md.append(
                f"- {v}: largest |difference| {max(diffs):.4f} nats over {len(diffs)} runs; noise per run {noise:.3f}"
            )
        md.append("")
    return "\n".join(md)


def to_json(result: dict) -> dict:
    """The result without bootstrap arrays: profiles as their vertices and statuses."""
    profiles = {
        v: {f"{c:.6g}": {"status": p.status, "sizes": p.sizes, "seeds": p.seeds, "loss": p.loss.tolist(),
                         "N_star": math.exp(p.vertex[0]) if p.vertex else None, "L_star": p.vertex[1] if p.vertex else None}
            for c, p in ps.items()}
        for v, ps in result["profiles"].items()
    }  # fmt: skip
    laws = {v: {k: ({kk: vv for kk, vv in e.items() if kk != "draws"} if isinstance(e, dict) else e)
                for k, e in law.items()} for v, law in result["laws"].items()}  # fmt: skip
    mult = {
        v: {**m, "per_budget": {f"{c:.6g}": e for c, e in m["per_budget"].items()}}
        for v, m in result["multipliers"].items()
    }
    predicted = {
        v: e if "error" in e else {f"{c:.6g}": x for c, x in e.items()} for v, e in result["predicted"].items()
    }
    return {**result, "profiles": profiles, "laws": laws, "multipliers": mult,
            "held_out": result["held_out"], "predicted": predicted}  # fmt: skip


def plot_profiles(result: dict, png: Path) -> Path:
    """Loss against N per budget (points and parabola), one panel per variant."""
    import matplotlib  # deferred: heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: heavy

    variants = list(result["profiles"])
    fig, axes = plt.subplots(1, len(variants), figsize=(4.2 * len(variants), 3.6), sharey=True, squeeze=False)
    for ax, variant in zip(axes[0], variants):
        for c, p in sorted(result["profiles"][variant].items()):
            (h,) = ax.plot(np.exp(p.logN), p.loss, "o", ms=3, label=f"{c:.2g}")
            gpu = np.array([d == "cuda" for d in p.devices], dtype=bool)
            if gpu.any():  # another device's points: ringed, so a reader sees which sizes trained where
                ax.plot(np.exp(p.logN[gpu]), p.loss[gpu], "o", ms=7, mfc="none", color=h.get_color(), mew=0.8)
            if len(set(p.sizes)) >= 3 and (fit := local_fit(p.logN, p.loss)) is not None:
                x = np.linspace(p.logN[fit[0]].min(), p.logN[fit[0]].max(), 50)
                ax.plot(np.exp(x), np.polyval(fit[1], x), "-", color=h.get_color(), lw=1)
            if p.vertex:
                ax.plot(math.exp(p.vertex[0]), p.vertex[1], "k*", ms=7)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # decade labels only: the minor ones overlap
        ax.set_title(variant)
        ax.set_xlabel("non-embedding parameters")
        ax.legend(title="FLOPs", fontsize=7)
    axes[0][0].set_ylabel("final validation loss")
    if any(d == "cuda" for ps in result["profiles"].values() for p in ps.values() for d in p.devices):
        fig.text(0.01, 0.01, "ringed: trained on the GPU (fp32); the rest on the CPU", fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def plot_multipliers(result: dict, png: Path) -> Path | None:
    """Each variant's compute multiplier against C with its interval (hollow where extrapolated) and its
    bound from rows where it has one (a downward triangle: at most), on log axes; None when there is none."""
    import matplotlib  # deferred: heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: heavy

    if not any(m["per_budget"] for m in result["multipliers"].values()):
        return None
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    for variant, m in result["multipliers"].items():
        budgets = sorted(m["per_budget"])
        mult = np.array([m["per_budget"][c]["multiplier"] for c in budgets])
        lo, hi = (np.array([m["per_budget"][c]["interval"][i] for c in budgets]) for i in (0, 1))
        (line_,) = ax.plot(budgets, mult, "-", label=variant)
        ax.fill_between(budgets, lo, hi, color=line_.get_color(), alpha=0.2, lw=0)
        for c, y in zip(budgets, mult):
            face = "none" if m["per_budget"][c]["extrapolated"] else line_.get_color()
            ax.plot(c, y, "o", mfc=face, mec=line_.get_color())
            if (bound := m["per_budget"][c].get("at_most")) is not None:  # the law-free bound: at most this
                ax.plot(c, bound, "v", ms=8, color=line_.get_color())
    if any("at_most" in e for m in result["multipliers"].values() for e in m["per_budget"].values()):
        ax.plot([], [], "kv", label="at most (from rows, no law)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs (the variant's own)")
    ax.set_ylabel("standard's FLOPs for the same loss / C")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
