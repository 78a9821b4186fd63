"""The compute multiplier under every defensible analysis choice: a systematic band to quote beside the
bootstrap interval, since the choices move the answer more than the seeds do.

Each combination is a re-analysis of the rows with the profile code (`profiles`) or the joint fit (`fit`):
- validation set: the pooled loss (`final_val_loss`) or one set's (linux-doc, gcide; python-doc's set is
  1,208 tokens and is left out);
- approach 2 (IsoFLOP profiles) with
  - the profile window: the lowest-mean size and 2 (the published analysis) or 1 sizes on either side;
  - standard's map from a loss to the compute it needs: the power law L* ~ C^c through all its
    identified optima (published), the same through the budgets the variants share only, a law with an
    irreducible term L* = E + k C^-c (not identified where the fit is degenerate: a parameter at a bound
    of its search, or no fit), or interpolation without a law (piecewise linear in log C against log L*
    between standard's optima; no value beyond them, "outside", where only the law-free bound stands);
- approach 3: L(N, D) = E + A N^-alpha + B D^-beta fitted to each variant's cooled rows, each variant's
  compute-optimal frontier in its own FLOPs per token (from its rows), and the multiplier: standard's
  frontier compute to reach the variant's frontier loss, over C; its interval a parametric bootstrap.
The band at a budget is the range of the combinations' multipliers that lie within standard's measured
optima (a law read beyond them is extrapolated and left out of it, and shown); the decision rule
("moves with scale" iff the slope's 95 % interval excludes 0) is applied per combination.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from common.errors import StudyError
from eval.report import markdown_table

from .fit import fit_joint, fit_power_law, flops_curve, frontier, parametric_samples
from .profiles import (
    LEVEL,
    POOLED,
    STANDARD,
    Profile,
    analyse,
    compute_multipliers,
    interval,
    invert_multipliers,
    laws,
    line,
    local_fit,
    standard_curve,
)

# validation sets: label -> the rows' key (python-doc's 1,208 tokens are too few to stand alone)
SETS = {"pooled": POOLED, "linux-doc": "val_loss/linux-doc", "gcide": "val_loss/gcide"}
WINDOWS = (2, 1)  # sizes on either side of the lowest in a profile's parabola; 2 is the published one
MAPS = {
    "law": "power law through all standard's optima",
    "law, shared budgets": "power law through standard's optima at the variants' budgets only",
    "law with a floor": "L* = E + k C^-c, E fitted",
    "interpolation": "piecewise linear in log C vs log L* between standard's optima, no law",
}
BASELINE = ("pooled", "2", 2, "law")  # the published analysis: (set, approach, window, map)
FRONTIER_SIZES = 240  # points of each variant's N grid (its rows' range) for a frontier


def combination(
    variant: str, metric: str, approach: str, window: int | None, how: str | None, found: dict | str
) -> dict[str, Any]:
    """One row of the band: a variant's multipliers under one set of choices (`found`: invert_multipliers'
    entry of the variant, or why there is none)."""
    entry = {"variant": variant, "set": metric, "approach": approach, "window": window, "map": how}
    if isinstance(found, str):
        return {**entry, "status": found, "per_budget": {}, "trend": None}
    return {**entry, "status": "identified", **found}


def floor_map(std: dict[float, Profile]) -> tuple[Callable, Callable, int, str] | str:
    """Standard's compute at a loss through L* = E + k C^-c fitted to its optima (studies.scaling.fit's
    fit_power_law), and through the same law refitted to each bootstrap draw of them; why not, when the
    fit is degenerate or fails."""
    ids = sorted((c, p) for c, p in std.items() if p.vertex is not None)
    C = np.array([c for c, _ in ids])
    try:
        fit = fit_power_law(C, [p.vertex[1] for _, p in ids])
    except (ValueError, RuntimeError) as e:
        return f"not identified: {e}"
    if why := fit.at_bounds():
        return f"not identified: {'; '.join(why)}"

    def through(E: float, A: float, alpha: float, loss: float) -> float:
        return (A / (loss - E)) ** (1 / alpha) if np.isfinite(loss) and loss > E else math.nan

    n = min(len(p.draws) for _, p in ids)
    drawn = []
    for j in range(n):
        losses = np.array([p.draws[j, 1] for _, p in ids])
        try:
            f = fit_power_law(C, losses) if np.all(np.isfinite(losses)) else None
        except (ValueError, RuntimeError):
            f = None
        drawn.append((f.E, f.A, f.alpha) if f is not None else (math.nan,) * 3)
    note = f"E = {fit.E:.3g} ± {fit.E_err:.2g}, c = -{fit.alpha:.3g} ± {fit.alpha_err:.2g}"
    return (lambda loss: through(fit.E, fit.A, fit.alpha, loss)), (lambda j, loss: through(*drawn[j], loss)), n, note


def interpolation_map(std: dict[float, Profile]) -> tuple[Callable, Callable, int] | str:
    """Standard's compute at a loss, piecewise linear in log C against log L* between its optima (no
    law), and the same through each bootstrap draw of them; NaN beyond them, or where the optima do not
    fall with every budget (no one compute per loss)."""
    ids = sorted((c, p) for c, p in std.items() if p.vertex is not None)
    if len(ids) < 2:
        return f"not identified: {len(ids)} identified standard profile(s); interpolation needs 2"
    logC = np.log([c for c, _ in ids])

    def through(optima: np.ndarray, loss: float) -> float:
        logL = np.log(optima)
        if not np.all(np.isfinite(logL)) or np.any(np.diff(logL) >= 0) or not np.isfinite(loss):
            return math.nan
        if not logL.min() <= math.log(loss) <= logL.max():
            return math.nan
        return math.exp(np.interp(math.log(loss), logL[::-1], logC[::-1]))

    central = np.array([p.vertex[1] for _, p in ids])
    if np.any(np.diff(central) >= 0):
        return "not identified: standard's L* does not fall with every budget (no one compute per loss)"
    n = min(len(p.draws) for _, p in ids)
    draws = np.array([[p.draws[j, 1] for _, p in ids] for j in range(n)])
    return (lambda loss: through(central, loss)), (lambda j, loss: through(draws[j], loss)), n


def approach2(rows: list[dict[str, Any]], metric: str, half: int, n_boot: int, seed: int) -> dict[str, Any]:
    """Every map of standard's compute through one window's profiles of one metric: {"combinations",
    "held_out", "profile_fits", "noise"}."""
    label = next(k for k, v in SETS.items() if v == metric)
    result = analyse(rows, metric, n_boot=n_boot, seed=seed, half=half)
    fits = result["profiles"]
    if STANDARD not in fits or len(fits) < 2:
        raise StudyError(
            f"the rows hold {sorted(fits)}: a multiplier needs standard's profiles and another variant's. "
            "Fix: the IsoFLOP grid's rows of standard and the variants"
        )
    curve = standard_curve(rows, metric)
    std = fits[STANDARD]
    variants = [v for v in fits if v != STANDARD]
    found: dict[str, dict[str, Any] | str] = {}
    law = result["laws"][STANDARD]
    found["law"] = result["multipliers"] or f"not identified: {law.get('error')}"
    shared = sorted({c for v in variants for c in fits[v]})
    shared_law = laws(std, [c for c in std if shared[0] <= c <= shared[-1]])
    found["law, shared budgets"] = (
        compute_multipliers(fits, {STANDARD: shared_law}, curve)
        if "error" not in shared_law
        else f"not identified: {shared_law['error']}"
    )
    notes = {"law, shared budgets": "budgets " + ", ".join(f"{c:.3g}" for c in shared_law["budgets"])}
    floor = floor_map(std)
    if isinstance(floor, str):
        found["law with a floor"] = floor
    else:
        *maps, notes["law with a floor"] = floor
        found["law with a floor"] = invert_multipliers(fits, *maps, curve, extrapolates=True)
    interp = interpolation_map(std)
    found["interpolation"] = (
        interp if isinstance(interp, str) else invert_multipliers(fits, *interp, curve, extrapolates=False)
    )
    out = []
    for how, f in found.items():
        for v in variants:
            row = combination(v, label, "2", half, how, f if isinstance(f, str) else f[v])
            out.append({**row, "note": notes.get(how, "")})
    return {
        "combinations": out,
        "held_out": result["held_out"],
        "profile_fits": profile_fits(fits, result["noise"], half),
        "noise": result["noise"],
    }


def profile_fits(fits: dict[str, dict[float, Profile]], noise: dict[str, dict], half: int) -> list[dict[str, Any]]:
    """How well each profile's parabola fits its points: chi2 of the residuals against the variant's
    noise per run (dof: points less 3), and how far the vertex sits above the lowest point it was fitted
    to (a vertex well above it says the points are not one parabola)."""
    out = []
    for variant, profiles in fits.items():
        sigma = noise[variant]["sigma"]
        for c, p in sorted(profiles.items()):
            fit = local_fit(p.logN, p.loss, half)
            if fit is None or p.vertex is None:
                continue
            keep, coef = fit
            resid = p.loss[keep] - np.polyval(coef, p.logN[keep])
            dof = int(keep.sum()) - 3
            chi2 = float(np.sum(resid**2) / sigma**2) if dof > 0 and math.isfinite(sigma) else None
            lowest = int(np.argmin(np.where(keep, p.loss, np.inf)))
            out.append(
                {"variant": variant, "budget": c, "window": half, "points": int(keep.sum()), "dof": dof,
                 "chi2": chi2, "p_value": chi2_tail(chi2, dof) if chi2 is not None else None,
                 "vertex_above_lowest": p.vertex[1] - float(p.loss[lowest]), "lowest_size": p.sizes[lowest]}
            )  # fmt: skip
    return out


def chi2_tail(chi2: float, dof: int) -> float:
    from scipy.stats import chi2 as distribution  # deferred: heavy

    return float(distribution.sf(chi2, dof))


def approach3(rows: list[dict[str, Any]], metric: str, draws: int, seed: int) -> list[dict[str, Any]]:
    """Chinchilla's approach 3 per variant: the joint law fitted to its cooled rows, its frontier in its
    own FLOPs per token, and the multiplier at each of its IsoFLOP budgets through standard's frontier,
    with a parametric bootstrap (draw j of the variant against draw j of standard)."""
    label = next(k for k, v in SETS.items() if v == metric)
    laws_of: dict[str, dict[str, Any]] = {}
    for variant in sorted({r["variant"] for r in rows}):
        pts = [
            r
            for r in rows
            if r["variant"] == variant and r.get("budget") and r.get("cooled") and isinstance(r.get(metric), float)
        ]
        N = np.array([float(r["non_embedding_params"]) for r in pts])
        D = np.array([float(r["tokens"]) for r in pts])
        try:
            fit = fit_joint(N, D, [float(r[metric]) for r in pts], n_boot=0)
        except StudyError as e:
            laws_of[variant] = {"error": f"not identified: {e}"}
            continue
        laws_of[variant] = {
            "fit": fit,
            "samples": parametric_samples(fit, N, D, draws, seed),
            "flops": flops_curve(N, [float(r["flops"]) / float(r["tokens"]) for r in pts]),
            "grid": np.geomspace(N.min(), N.max(), FRONTIER_SIZES),
            "budgets": sorted({float(r["budget"]) for r in pts}),
        }
    if STANDARD not in laws_of:
        raise StudyError("no standard rows: a multiplier reads standard's compute. Fix: the grid's rows of standard")
    base = laws_of[STANDARD]
    out = []
    for variant, own in laws_of.items():
        if variant == STANDARD:
            continue
        if "error" in own or "error" in base:
            out.append({**combination(variant, label, "3", None, None, own.get("error") or base["error"]), "note": ""})
            continue
        span = (min(base["budgets"]), max(base["budgets"]))
        C = np.geomspace(span[0] / 1e3, span[1] * 10, 800)  # standard's frontier far below its rows too

        def multipliers(params: dict[str, float], std_params: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
            """(the multiplier at each budget, the compute standard needs there) under one pair of laws."""
            front = frontier(std_params, base["flops"], C, base["grid"])["L"]
            at = frontier(params, own["flops"], np.array(own["budgets"]), own["grid"])["L"]
            ok = (at >= front.min()) & (at <= front.max()) & np.all(np.diff(front) <= 0)
            needed = np.where(ok, np.exp(np.interp(-at, -front, np.log(C))), np.nan)
            return needed / np.array(own["budgets"]), needed

        fit, std_fit = own["fit"], base["fit"]
        central, needed = multipliers(fit.params(), std_fit.params())
        drawn = np.array([multipliers(a, b)[0] for a, b in zip(own["samples"], base["samples"])])
        edge = frontier(fit.params(), own["flops"], np.array(own["budgets"]), own["grid"])["N"]
        per_budget = {}
        for i, c in enumerate(own["budgets"]):
            per_budget[c] = {
                "multiplier": float(central[i]),
                "interval": interval(drawn[:, i]) if len(drawn) else (math.nan, math.nan),
                "extrapolated": not span[0] <= needed[i] <= span[1],
                "frontier_at_an_edge": bool(edge[i] in (own["grid"][0], own["grid"][-1])),
            }
        x = np.log10(own["budgets"])
        ok = np.isfinite(central)
        trend = None
        if ok.sum() >= 2:
            slopes = np.array([line(x[ok], np.log10(row[ok]))[1] for row in drawn])
            lo, hi = interval(slopes)
            known = math.isfinite(lo) and math.isfinite(hi)
            trend = {
                "per_decade": line(x[ok], np.log10(central[ok]))[1],
                "interval": (lo, hi),
                "moves": bool(lo > 0 or hi < 0) if known else None,
            }
        pair = ((STANDARD, std_fit), (variant, fit))
        why = [f"{who}'s fit: {'; '.join(f.at_bounds())}" for who, f in pair if f.at_bounds()]
        caveats = [f"{who}: {'; '.join(f.not_identified())}" for who, f in pair if f.not_identified()]
        note = f"RMS log error {std_fit.rmse_log:.3f} (standard), {fit.rmse_log:.3f} ({variant})"
        if caveats:
            note += "; by the fits' rule (90 % parametric intervals): " + " / ".join(caveats)
        status = "not identified: " + "; ".join(why) if why else "identified"
        found = {"per_budget": per_budget, "trend": trend, "note": note}
        out.append({**combination(variant, label, "3", None, None, found), "status": status})
    return out


def band(rows: list[dict[str, Any]], n_boot: int = 1000, draws: int = 200, seed: int = 0) -> dict[str, Any]:
    """Every combination of the choices for every variant, the band they span per budget and of the
    slope, the published analysis beside it, and the choices one at a time from it."""
    metrics = {
        label: key
        for label, key in SETS.items()
        if any(r.get("budget") and r.get("cooled") and isinstance(r.get(key), float) for r in rows)
    }
    if POOLED not in metrics.values():
        raise StudyError(
            "no IsoFLOP rows (cooled branches with a budget and a final_val_loss). Fix: the isoflop command's rows"
        )
    combos, held, fits, noise = [], [], [], {}
    for label, key in metrics.items():
        for half in WINDOWS:
            two = approach2(rows, key, half, n_boot, seed)
            combos += two["combinations"]
            held += [{"set": label, "window": half, "variant": v, **h} for v, h in two["held_out"].items()]
            fits += [{"set": label, **f} for f in two["profile_fits"]]
            noise[f"{label}, ±{half}"] = two["noise"]
        combos += approach3(rows, key, draws, seed)
    return {
        "sets": metrics,
        "left_out": {"python-doc": "its validation set is 1,208 tokens (3 documents): too noisy to stand alone"},
        "combinations": combos,
        "summary": summarise(combos),
        "held_out": held,
        "profile_fits": fits,
        "noise": noise,
    }


def usable(e: dict[str, Any]) -> bool:
    """A multiplier that counts in the band: a value, read within standard's measured optima."""
    return math.isfinite(e["multiplier"]) and not e["extrapolated"]


def summarise(combos: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: the band (min-max over the identified combinations) of the multiplier at each budget
    and of the slope, the published combination's value and interval beside it, the extrapolated range,
    and each choice's move from the published analysis with the others held."""
    out: dict[str, Any] = {}
    for variant in sorted({c["variant"] for c in combos}):
        own = [c for c in combos if c["variant"] == variant and c["status"] == "identified"]
        base = next((c for c in own if key_of(c) == BASELINE), None)
        budgets = sorted({b for c in own for b in c["per_budget"]})
        per_budget = {}
        for b in budgets:
            entries = [(c, c["per_budget"][b]) for c in own if b in c["per_budget"]]
            inside = [(c, e) for c, e in entries if usable(e)]
            beyond = [e["multiplier"] for c, e in entries if math.isfinite(e["multiplier"]) and e["extrapolated"]]
            bounds = [e["at_most"] for _, e in entries if e.get("at_most") is not None]
            low = min(inside, key=lambda ce: ce[1]["multiplier"], default=None)
            high = max(inside, key=lambda ce: ce[1]["multiplier"], default=None)
            per_budget[b] = {
                "band": [low[1]["multiplier"], high[1]["multiplier"]] if inside else None,
                "lowest": label_of(low[0]) if low else None,
                "highest": label_of(high[0]) if high else None,
                "combinations": len(inside),
                "extrapolated_range": [min(beyond), max(beyond)] if beyond else None,
                "at_most": sorted(set(bounds)) or None,
                "published": base["per_budget"].get(b) if base else None,
            }
            if base and (bound := base["per_budget"].get(b, {}).get("at_most")) is not None:
                per_budget[b]["standard_reached_it_at"] = bound * b  # FLOPs: the bound is this over C
        whole = [c for c in own if c["trend"] and all(usable(e) for e in c["per_budget"].values())]
        slopes = [(c, c["trend"]["per_decade"]) for c in whole]
        verdicts = [c["trend"]["moves"] for c in whole]
        beyond = [c["trend"]["per_decade"] for c in own if c["trend"] and c not in whole]
        out[variant] = {
            "per_budget": per_budget,
            "slope_band": [min(s for _, s in slopes), max(s for _, s in slopes)] if slopes else None,
            "slope_lowest": label_of(min(slopes, key=lambda cs: cs[1])[0]) if slopes else None,
            "slope_highest": label_of(max(slopes, key=lambda cs: cs[1])[0]) if slopes else None,
            "slope_combinations": len(slopes),
            "extrapolated_slope_range": [min(beyond), max(beyond)] if beyond else None,
            "slope_spread_by_choice": spread_by_choice(whole),
            "moves": {"yes": verdicts.count(True), "no": verdicts.count(False), "no interval": verdicts.count(None)},
            "published_trend": base["trend"] if base else None,
            "one_at_a_time": one_at_a_time([c for c in combos if c["variant"] == variant], base) if base else [],
        }
    return out


def spread_by_choice(whole: list[dict[str, Any]]) -> dict[str, float]:
    """For each choice, the largest change of the slope between two of its options with every other
    choice held, over all settings of the others (approach 3, which has no window or map, against each
    approach-2 combination of its set)."""
    out = {}
    for i, name in ((0, "validation set"), (2, "window"), (3, "standard's map")):
        groups: dict[tuple, list[float]] = {}
        for c in whole:
            if c["approach"] == "2":
                others = tuple(k for j, k in enumerate(key_of(c)) if j != i)
                groups.setdefault(others, []).append(c["trend"]["per_decade"])
        spans = [max(g) - min(g) for g in groups.values() if len(g) > 1]
        if spans:
            out[name] = max(spans)
    three = {c["set"]: c["trend"]["per_decade"] for c in whole if c["approach"] == "3"}
    spans = [
        abs(c["trend"]["per_decade"] - three[c["set"]]) for c in whole if c["approach"] == "2" and c["set"] in three
    ]
    if spans:
        out["approach 3 against 2"] = max(spans)
    return out


def key_of(c: dict[str, Any]) -> tuple:
    return (c["set"], c["approach"], c["window"], c["map"])


def label_of(c: dict[str, Any]) -> str:
    """A combination in words: set, approach, window and map."""
    if c["approach"] == "3":
        return f"{c['set']}, approach 3"
    return f"{c['set']}, window ±{c['window']}, {c['map']}"


def one_at_a_time(own: list[dict[str, Any]], base: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice changed alone from the published analysis: its multipliers' largest factor from the
    published ones over the budgets, and its slope's change."""
    s, _, w, m = BASELINE
    alone = [(s, "2", 1, m), *((s, "2", w, how) for how in MAPS if how != m), (s, "3", None, None)]
    alone += [(label, "2", w, m) for label in SETS if label != s]
    by_key = {key_of(c): c for c in own}
    out = []
    for key in alone:
        c = by_key.get(key)
        if c is None:
            continue
        if c["status"] != "identified":
            out.append({"choice": label_of(c), "status": c["status"]})
            continue
        factors = [
            c["per_budget"][b]["multiplier"] / e["multiplier"]
            for b, e in base["per_budget"].items()
            if b in c["per_budget"] and math.isfinite(c["per_budget"][b]["multiplier"])
        ]
        if not factors:
            out.append({"choice": label_of(c), "status": "no multiplier within standard's optima: the bound only"})
            continue
        slope = c["trend"]["per_decade"] if c["trend"] else None
        out.append(
            {"choice": label_of(c), "largest_factor": max(factors, key=lambda f: abs(math.log(f))) if factors else None,
             "slope": slope, "slope_change": slope - base["trend"]["per_decade"] if slope is not None else None}
        )  # fmt: skip
    return out


def _cell(e: dict[str, Any] | None) -> str:
    if e is None:
        return "—"
    if not math.isfinite(e["multiplier"]):
        bound = e.get("at_most")
        return "outside" + (f"; at most {bound:.3g}" if bound is not None else "")
    lo, hi = e["interval"]
    iv = f" [{lo:.3g}, {hi:.3g}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    flags = " (extrap.)" if e["extrapolated"] else ""
    flags += " (edge)" if e.get("frontier_at_an_edge") else ""
    return f"{e['multiplier']:.3g}{iv}{flags}"


def _trend(t: dict[str, Any] | None) -> list[str]:
    if not t:
        return ["—", "—"]
    lo, hi = t["interval"]
    iv = f" [{lo:+.3f}, {hi:+.3f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    verdict = {True: "moves", False: "does not move", None: "no interval"}[t["moves"]]
    return [f"{t['per_decade']:+.3f}{iv}", verdict]


def report_markdown(result: dict[str, Any]) -> str:
    """The band's page: the summary per variant, every combination's multipliers, the profiles' fit, the
    held-out budget per window."""
    md = [f"### The compute multiplier under every analysis choice ({LEVEL:.0%} bootstrap intervals)", ""]
    md += [
        "Validation sets: " + ", ".join(f"{k} (`{v}`)" for k, v in result["sets"].items())
        + "; left out: " + "; ".join(f"{k}, {why}" for k, why in result["left_out"].items()) + ".",
        "Approach 2 maps of standard's compute at a loss: " + "; ".join(f"**{k}**: {v}" for k, v in MAPS.items())
        + ". Approach 3: L(N, D) = E + A N^-alpha + B D^-beta per variant, frontiers in each variant's own FLOPs "
        "per token, a parametric bootstrap. Not identified: the fit is degenerate (a parameter at a bound of its "
        "search) or there is none. The band counts the multipliers read within standard's measured optima "
        "(extrap.: a law read beyond them; outside: interpolation has no value there, the law-free bound stands).",
        "",
    ]  # fmt: skip
    for variant, s in result["summary"].items():
        md += [f"#### {variant}: the band", ""]
        rows = []
        for b, e in s["per_budget"].items():
            pub = _cell(e["published"]) if e["published"] else "—"
            band_ = (
                f"{e['band'][0]:.3g} - {e['band'][1]:.3g} ({e['combinations']} combinations)" if e["band"] else "none"
            )
            ends = f"{e['lowest']} / {e['highest']}" if e["band"] else "—"
            beyond = "{:.3g} - {:.3g}".format(*e["extrapolated_range"]) if e["extrapolated_range"] else "—"
            bound = ", ".join(f"{x:.3g}" for x in e["at_most"]) if e["at_most"] else "—"
            if "standard_reached_it_at" in e:
                bound += f" (published: standard reached that loss at {e['standard_reached_it_at']:.3g} FLOPs)"
            rows.append([f"{b:.3g}", pub, band_, ends, beyond, bound])
        pt = s["published_trend"]
        rows.append(
            ["slope per decade", " ".join(_trend(pt)) if pt else "—",
             ("{:+.3f} - {:+.3f}".format(*s["slope_band"]) + f" ({s['slope_combinations']} combinations)")
             if s["slope_band"] else "none", f"{s['slope_lowest']} / {s['slope_highest']}" if s["slope_band"] else "—",
             "—", "—"]
        )  # fmt: skip
        header = ["budget", "published (window ±2, law, pooled)", "band", "lowest / highest", "extrapolated", "at most"]
        md += [markdown_table(header, rows), ""]
        v = s["moves"]
        md += [
            f"The rule per combination with a whole slope: moves in {v['yes']}, does not move in {v['no']}, "
            f"no interval in {v['no interval']}."
            + (
                " Slopes of the combinations with an extrapolated multiplier: {:+.3f} - {:+.3f}.".format(
                    *s["extrapolated_slope_range"]
                )
                if s["extrapolated_slope_range"]
                else ""
            )
            + (
                " Largest slope change from one choice, the others held: "
                + ", ".join(f"{k} {x:.3f}" for k, x in s["slope_spread_by_choice"].items())
                + "."
                if s["slope_spread_by_choice"]
                else ""
            ),
            "",
        ]
        alone = [
            [a["choice"], a["status"], "", ""] if "status" in a else
            [a["choice"], f"x{a['largest_factor']:.3g}" if a["largest_factor"] else "—",
             f"{a['slope']:+.3f}" if a["slope"] is not None else "—",
             f"{a['slope_change']:+.3f}" if a["slope_change"] is not None else "—"]
            for a in s["one_at_a_time"]
        ]  # fmt: skip
        if alone:
            md += ["One choice at a time from the published analysis:", ""]
            md += [markdown_table(["choice", "multiplier, largest factor", "slope", "slope change"], alone), ""]
    md += ["#### Every combination", ""]
    budgets = sorted({b for c in result["combinations"] for b in c["per_budget"]})
    rows = []
    for c in result["combinations"]:
        head = [c["variant"], c["set"], c["approach"], f"±{c['window']}" if c["window"] else "—", c["map"] or "—"]
        if c["status"] != "identified" and not c["per_budget"]:
            rows.append([*head, c["status"], *[""] * (len(budgets) + 1)])
            continue
        cells = [_cell(c["per_budget"].get(b)) for b in budgets]
        rows.append([*head, *cells, *_trend(c["trend"])])
        if c["status"] != "identified":
            rows[-1][5] = f"{c['status']}: {rows[-1][5]}"
    header = ["variant", "set", "approach", "window", "standard's map", *(f"{b:.3g}" for b in budgets)]
    md += [markdown_table([*header, "slope per decade", "rule"], rows), ""]
    notes = [f"- {label_of(c)} ({c['variant']}): {c['note']}" for c in result["combinations"] if c.get("note")]
    md += ["Notes:", "", *dict.fromkeys(notes), ""]
    fits = [
        [f["set"], f["variant"], f"{f['budget']:.3g}", f"±{f['window']}", f["points"],
         f"{f['chi2']:.1f} on {f['dof']}" if f["chi2"] is not None else f"— ({f['dof']} dof)",
         f"{f['p_value']:.2g}" if f["p_value"] is not None else "—", f"{f['vertex_above_lowest']:+.3f} ({f['lowest_size']})"]
        for f in result["profile_fits"] if f["set"] == "pooled"
    ]  # fmt: skip
    md += ["#### The profiles' parabolas (pooled set): chi2 against the noise per run", ""]
    md += [
        markdown_table(["set", "variant", "budget", "window", "points", "chi2", "p", "vertex less lowest point"], fits)
    ]
    md += [""]
    held = [
        [h["set"], f"±{h['window']}", h["variant"],
         f"{h['predicted']:.3f} vs {h['measured']:.3f}" if "predicted" in h else "—",
         f"{h['relative_error']:+.2%}" if "relative_error" in h else h.get("error", "—")]
        for h in result["held_out"]
    ]  # fmt: skip
    md += ["#### Held out: the largest budget's L* predicted from the others, per window", ""]
    md += [markdown_table(["set", "window", "variant", "L* predicted vs measured", "error"], held), ""]
    return "\n".join(md)


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    """The band with budgets as strings."""

    def budgets(d: dict) -> dict:
        return {f"{b:.6g}": e for b, e in d.items()}

    combos = [{**c, "per_budget": budgets(c["per_budget"])} for c in result["combinations"]]
    summary = {v: {**s, "per_budget": budgets(s["per_budget"])} for v, s in result["summary"].items()}
    return {**result, "combinations": combos, "summary": summary}
