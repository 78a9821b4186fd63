"""A learning rate per variant and size: a grid at the smaller sizes, and the rule that carries it on.

Each (variant, size, rate) trains a short full schedule (wsd, so it ends at min_lr) of `budget`
tokens per non-embedding parameter; the best rate of a (variant, size) is the vertex of a parabola in
log(lr) through its lowest final validation loss and the two neighbours, and a lowest loss at either
end of its grid is an error (the optimum may lie beyond it). The rule is a least-squares fit of
log(best rate) against log N with one slope shared by the variants and an intercept of each
(`rate_rule`), evaluated at every ladder size: frozen parts change the effective parametrisation, so
variants get their own rates. (The ladder's rows were trained under the standard parametrisation; µP,
`model.parametrization: mup`, now gives the trainer a width rule of its own, which this fit predates.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import StudyError
from eval.report import markdown_table
from pretrain.config import load_recipe

from .ladder import LADDER, SHAPES, model_overrides, non_embedding_params, per_size, shape_overrides
from .runs import DONE, RowLog, collect_run, run_chains, threads_per_job, tracker_overrides, train_once


def rate_name(variant: str, size: str, lr: float, seed: int = 0) -> str:
    """Seed 0 (the recipe's seed) has no suffix, so a sweep's rows stay its seed 0 when seeds are added."""
    return f"{variant}-{size}-lr{lr:g}" + (f"-s{seed}" if seed else "")


def rate_overrides(
    variant: str,
    size: str,
    lr: float,
    budget: float,
    batch: int | None = None,
    tokens: int | None = None,
    min_lr_fraction: float | None = None,
    seed: int = 0,
    base_seed: int = 0,
) -> list[str]:
    """A grid point: a full wsd schedule of `budget` tokens per parameter (or `tokens`, the same for
    every size, as a transfer check compares widths at) at rate `lr`, decaying to the recipe's min_lr
    or to `min_lr_fraction` x lr; the ladder's batch for that size, when given, since the best rate
    depends on it. Seed i > 0 trains with the recipe's seed (`base_seed`) + i: its init and data order."""
    tokens = tokens or int(budget * non_embedding_params(size))
    batch_keys = (
        [] if batch is None else [f"train.global_batch_sequences={batch}", f"train.micro_batch_sequences={batch}"]
    )
    floor = [] if min_lr_fraction is None else [f"optim.min_lr={lr * min_lr_fraction:.6g}"]
    return [
        *batch_keys,
        *shape_overrides(size),
        f"model.variant={variant}",
        *([f"seed={base_seed + seed}"] if seed else []),
        f"name={rate_name(variant, size, lr, seed)}",
        f"optim.lr={lr}",
        *floor,
        "optim.decay=wsd",
        f"train.max_tokens={tokens}",
        "train.max_steps=null",
    ]


def best_rate(grid: list[float], losses: list[float], half: int = 1) -> float:
    """The vertex of the parabola in log(lr) through the grid's lowest loss and its neighbours, `half` on
    either side (the rule's: one): a noisy grid's lowest point jumps between neighbours on a flat bottom,
    the vertex moves little. It lies within those neighbours; a lowest loss at either end of the grid has
    none (an error)."""
    i = int(np.argmin(losses))
    window = slice(max(0, i - half), i + half + 1)
    x = np.log(grid[window])
    a, b, _ = np.polyfit(x, losses[window], 2)
    vertex = -b / (2 * a) if a > 0 else math.log(grid[i])
    return float(math.exp(min(max(vertex, x[0]), x[-1])))


def grid_best(grid: list[float], losses: list[float], half: int = 1) -> float:
    """`best_rate`, or the edge rate itself where the lowest loss is at an edge (a bootstrap draw may
    put it there; the sweep's own choice refuses that)."""
    i = int(np.argmin(losses))
    return grid[i] if i in (0, len(grid) - 1) else best_rate(grid, losses, half)


def choose_rates(losses: dict[tuple[str, str, float], float]) -> dict[str, dict[str, float]]:
    """{(variant, size, lr): final loss} -> {variant: {size: best lr}} (`best_rate`); a lowest loss at the
    edge of its grid is a StudyError."""
    best: dict[str, dict[str, float]] = {}
    for variant, size in sorted({(v, s) for v, s, _ in losses}):
        grid = sorted(lr for v, s, lr in losses if (v, s) == (variant, size))
        if len(grid) < 3:
            raise StudyError(f"{variant} at {size}: {len(grid)} rates; a best rate needs a grid of >= 3. Fix: --lrs")
        values = [losses[(variant, size, r)] for r in grid]
        lowest = grid[int(np.argmin(values))]
        if lowest in (grid[0], grid[-1]):
            raise StudyError(
                f"{variant} at {size}: the lowest loss is at {lowest:g}, the edge of the grid "
                f"{[f'{g:g}' for g in grid]}, so the optimum may lie beyond it. Fix: extend --lrs past it and run "
                "lr-sweep again"
            )
        best.setdefault(variant, {})[size] = best_rate(grid, values)
    return best


def rate_rule(best: dict[str, dict[str, float]]) -> dict[str, dict]:
    """log(lr*) = intercept_variant + slope * log N, least squares through every variant's best rates
    with one slope shared by the variants and an intercept of each (variants keep their own rates),
    and the rate it gives at every ladder size. Three noisy best rates per variant do not determine a
    slope each (their lines would cross within the ladder); pooled they do, and the shared exponent is
    the width rule's question (1/width is N^-0.5 at a fixed depth-to-width ratio). With one size: that
    rate everywhere, slope 0."""
    variants = sorted(best)
    points = [(v, math.log(non_embedding_params(s, v)), math.log(lr)) for v in variants for s, lr in best[v].items()]
    if len({x for _, x, _ in points}) < 2:
        slope, intercepts = 0.0, {v: float(np.mean([y for u, _, y in points if u == v])) for v in variants}
    else:
        X = np.array([[x] + [float(v == u) for u in variants] for v, x, _ in points])
        coef = np.linalg.lstsq(X, np.array([y for *_, y in points]), rcond=None)[0]
        slope, intercepts = float(coef[0]), {v: float(c) for v, c in zip(variants, coef[1:])}
    return {
        v: {
            "slope": slope,
            "intercept": intercepts[v],
            "best": best[v],
            "rates": {s: float(math.exp(intercepts[v] + slope * math.log(non_embedding_params(s, v)))) for s in LADDER},
        }
        for v in variants
    }


def transfer_check(
    best: dict[str, dict[str, float]],
    parametrization: str,
    per_seed: dict[tuple[str, str, float], list[float]] | None = None,
    draws: int = 1000,
    half: int = 1,
) -> dict[str, dict]:
    """µP's promise, per variant swept at >= 2 sizes: the best rate at the widest size over the best rate
    at the narrowest, which holds within a factor sqrt(2) (Yang et al.'s transfer; judged on the
    seed-mean curves); `rate`, the geometric mean of the variant's best rates, is the one rate a µP study
    then trains every width at. With >= 2 seeds per point (`per_seed`, {(variant, size, lr): losses
    by seed}), `ratio_interval` is the 95 % bootstrap interval of the ratio: seeds drawn with replacement,
    the same draw at every rate of a size (a seed is one init and data order across the grid)."""
    out = {}
    rng = np.random.default_rng(0)
    for variant, rates in best.items():
        if len(rates) < 2:
            continue
        narrow, wide = sorted(rates, key=lambda s: SHAPES[s]["hidden_size"])[:: len(rates) - 1]
        ratio = rates[wide] / rates[narrow]
        out[variant] = {
            "parametrization": parametrization,
            "narrow": narrow,
            "wide": wide,
            "width_ratio": SHAPES[wide]["hidden_size"] / SHAPES[narrow]["hidden_size"],
            "rate_ratio": ratio,
            "holds": bool(abs(math.log(ratio)) <= 0.5 * math.log(2) + 1e-12),
            "rate": float(math.exp(np.mean(np.log(list(rates.values()))))),
        }
        curves = {}
        for size in (narrow, wide):
            grid = sorted(lr for v, s, lr in per_seed or {} if (v, s) == (variant, size))
            seeds = min((len(per_seed[(variant, size, lr)]) for lr in grid), default=0)
            if seeds >= 2:
                curves[size] = (grid, np.array([per_seed[(variant, size, lr)][:seeds] for lr in grid]))
        if len(curves) == 2:
            drawn = []
            for _ in range(draws):
                best_at = {}
                for size, (grid, by_seed) in curves.items():
                    pick = rng.integers(0, by_seed.shape[1], by_seed.shape[1])
                    best_at[size] = grid_best(grid, list(by_seed[:, pick].mean(axis=1)), half)
                drawn.append(best_at[wide] / best_at[narrow])
            out[variant]["seeds"] = int(min(c[1].shape[1] for c in curves.values()))
            out[variant]["ratio_interval"] = [float(q) for q in np.quantile(drawn, [0.025, 0.975])]
    return out


def seed_curves(rows: list[dict[str, Any]], metric: str = "final_val_loss") -> dict[str, dict]:
    """{variant: {"seeds": [...], "per_seed": {(variant, size, lr): losses in the seeds' order}}} from an
    lr-sweep's rows, keeping the seeds that trained at every (size, rate) of the variant, so that a
    seed's curve at one width and at another are the same init and data order."""
    by: dict[str, dict[tuple[str, str, float], dict[int, float]]] = {}
    for r in rows:
        if isinstance(r.get(metric), float):
            by.setdefault(r["variant"], {}).setdefault((r["variant"], r["size"], float(r["lr"])), {})[r["seed"]] = r[
                metric
            ]
    out = {}
    for variant, points in by.items():
        seeds = sorted(set.intersection(*(set(p) for p in points.values())))
        if seeds:
            out[variant] = {"seeds": seeds, "per_seed": {k: [p[s] for s in seeds] for k, p in points.items()}}
    return out


def transfer_sensitivity(rows: list[dict[str, Any]], halves: tuple[int, ...] = (1, 2), draws: int = 1000) -> dict:
    """The transfer check of an lr-sweep's rows again, per variant swept at two widths: for each window
    of the best-rate parabola (`half` rates on either side of the lowest; 1 is the rule's), the ratio of
    the seed-mean curves' best rates (the rule's verdict, within sqrt(2)), its bootstrap interval over
    seeds, and each seed's own ratio; a best rate at an edge of the grid is that rate, flagged. A
    variant with fewer than 3 rates at either width is no sweep and is left out."""
    out = {}
    for variant, found in seed_curves(rows).items():
        per_seed = found["per_seed"]
        sizes = sorted({s for _, s, _ in per_seed}, key=lambda s: SHAPES[s]["hidden_size"])
        if len(sizes) < 2:
            continue
        narrow, wide = sizes[0], sizes[-1]
        grids = {s: sorted(lr for _, z, lr in per_seed if z == s) for s in (narrow, wide)}
        if any(len(g) < 3 for g in grids.values()):  # not a sweep of rates (a best rate needs 3)
            continue
        windows = {}
        for half in halves:

            def best(size: str, curve: list[float], half: int = half) -> tuple[float, bool]:
                i = int(np.argmin(curve))
                return grid_best(grids[size], curve, half), i in (0, len(curve) - 1)

            mean = {s: [float(np.mean(per_seed[(variant, s, lr)])) for lr in grids[s]] for s in (narrow, wide)}
            (lo, lo_edge), (hi, hi_edge) = best(narrow, mean[narrow]), best(wide, mean[wide])
            check = transfer_check({variant: {narrow: lo, wide: hi}}, "", per_seed, draws, half)[variant]
            seeds = []
            for k, seed in enumerate(found["seeds"]):
                (a, a_edge), (b, b_edge) = (
                    best(s, [per_seed[(variant, s, lr)][k] for lr in grids[s]]) for s in (narrow, wide)
                )
                seeds.append({"seed": seed, "narrow": a, "wide": b, "ratio": b / a, "edge": a_edge or b_edge})
            windows[half] = {"narrow": lo, "wide": hi, "ratio": hi / lo, "holds": check["holds"], "edge": lo_edge or hi_edge,
                             "ratio_interval": check.get("ratio_interval"), "per_seed": seeds}  # fmt: skip
        out[variant] = {"narrow": narrow, "wide": wide, "seeds": found["seeds"], "windows": windows}
    return out


def sensitivity_table(checks: dict[str, dict[str, dict]]) -> str:
    """Markdown of `transfer_sensitivity` per row file: one line per (variant, window)."""
    rows = []
    for source, variants in checks.items():
        for variant, c in variants.items():
            for half, w in c["windows"].items():
                verdict = f"{w['ratio']:.2f} ({'within' if w['holds'] else 'beyond'} √2)" + (
                    " (edge)" if w["edge"] else ""
                )
                per_seed = ", ".join(f"{s['ratio']:.2f}" + ("*" if s["edge"] else "") for s in w["per_seed"])
                iv = "{:.2f}-{:.2f}".format(*w["ratio_interval"]) if w["ratio_interval"] else "— (one seed)"
                rows.append(
                    [source, variant, f"{c['narrow']} → {c['wide']}", len(c["seeds"]), f"±{half}",
                     f"{w['narrow']:.3g}", f"{w['wide']:.3g}", verdict, iv, per_seed]
                )  # fmt: skip
    header = ["rows", "variant", "widths", "seeds", "window", "best rate, narrow", "best rate, wide"]
    header += ["wide / narrow (seed mean)", "95 % interval over seeds", "per seed"]
    return (
        markdown_table(header, rows, right_from=3)
        + "\n\n(±1: the rule's parabola through the lowest rate and one on either side; ±2: two on either side. "
        "*: that seed's lowest loss at an edge of the grid, its best rate the edge rate.)\n"
    )


def lr_table(losses: dict[tuple[str, str, float], float], rule: dict[str, dict]) -> str:
    """Markdown: final validation loss of every grid point (its seeds' mean; the lowest of each row in
    bold), the best rate (the parabola's vertex), and the rule's rate at every ladder size."""
    grid = sorted({lr for *_, lr in losses})
    rows = []
    for variant, size in sorted({(v, s) for v, s, _ in losses}, key=lambda k: (k[0], non_embedding_params(k[1]))):
        row = {lr: losses.get((variant, size, lr)) for lr in grid}
        low = min(v for v in row.values() if v is not None)
        cells = ["—" if v is None else (f"**{v:.3f}**" if v == low else f"{v:.3f}") for v in row.values()]
        rows.append([variant, size, *cells, f"{rule[variant]['best'][size]:.2e}"])
    losses_md = markdown_table(["variant", "size", *(f"{lr:g}" for lr in grid), "best rate"], rows, right_from=2)
    rates = [
        [variant, f"{r['slope']:.3f}", *(f"{r['rates'][s]:.2e}" for s in LADDER)] for variant, r in sorted(rule.items())
    ]
    md = losses_md + "\n\n" + markdown_table(["variant", "slope", *LADDER], rates, right_from=1) + "\n"
    checks = [(v, r["transfer"]) for v, r in sorted(rule.items()) if "transfer" in r]
    if checks:
        header = ["variant", "parametrization", "widths", "best rate, narrow", "best rate, wide", "wide / narrow"]
        header += ["seeds", "95 % interval"]
        table = [
            [v, c["parametrization"], f"{c['narrow']} → {c['wide']} (×{c['width_ratio']:g})"]
            + [f"{r['best'][c['narrow']]:.2e}", f"{r['best'][c['wide']]:.2e}"]
            + [f"{c['rate_ratio']:.2f} ({'within' if c['holds'] else 'beyond'} √2)", str(c.get("seeds", 1))]
            + ["{:.2f}-{:.2f}".format(*c["ratio_interval"]) if "ratio_interval" in c else "— (one seed)"]
            for v, c in checks
            for r in [rule[v]]
        ]
        md += "\nTransfer check (the best rate moves by at most √2 across the widths):\n\n"
        md += markdown_table(header, table, right_from=3) + "\n"
    return md


def extra_rates(spec: str | None, variants: list[str]) -> dict[str, list[float]]:
    """`mixit=5e-4:1e-3,frozen_qk=6.4e-2` -> {variant: rates}: a variant's grid extended past an edge
    without training every other variant there too."""
    out: dict[str, list[float]] = {}
    for item in filter(None, (spec or "").split(",")):
        variant, _, rates = item.partition("=")
        try:
            values = [float(r) for r in rates.split(":")]
        except ValueError:
            values = []
        if variant not in variants or not values or any(r <= 0 for r in values):
            raise StudyError(
                f"--extra-lrs {item!r} must be VARIANT=LR:LR with a swept variant ({variants}) and positive rates. "
                "Fix: e.g. --extra-lrs mixit=5e-4:1e-3"
            )
        out[variant] = values
    return out


def lr_sweep(args) -> int:
    """Train every grid point (`--jobs` side by side, each a row in `--rows`), then choose the rates
    from the rows and write lr.json."""
    variants, sizes = args.variants.split(","), args.sizes.split(",")
    lrs = sorted(float(x) for x in args.lrs.split(","))
    extra = extra_rates(args.extra_lrs, variants)
    if args.seeds < 1:
        raise StudyError(f"--seeds {args.seeds}: at least 1. Fix: --seeds 3 for a transfer check with an interval")
    base_seed = load_recipe(args.recipe, args.overrides).seed
    points = [
        (v, s, lr, k)
        for k in range(args.seeds)  # seed-major: every rate of seed 0 first, so an early stop leaves whole curves
        for s in sizes
        for v in variants
        for lr in sorted({*lrs, *extra.get(v, [])})
    ]
    batches = per_size(args.batch_sequences, "--batch-sequences")

    def point_overrides(v: str, s: str, lr: float, k: int) -> list[str]:
        return rate_overrides(
            v, s, lr, args.budget, batches.get(s), args.tokens, args.min_lr_fraction, seed=k, base_seed=base_seed
        )

    for v, s, lr, k in points:  # a bad recipe, size or override fails here, before anything trains
        cfg = load_recipe(args.recipe, [*args.overrides, *point_overrides(v, s, lr, k)])
    out = Path(args.out)
    args.overrides += tracker_overrides(args.recipe, args.overrides, f"lr-sweep:{out.name}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    log, threads = RowLog(args.rows), threads_per_job(args.jobs)
    have = log.names()

    def train_point(v: str, s: str, lr: float, k: int) -> list[str]:
        run_dir = out / "runs" / rate_name(v, s, lr, k)
        if run_dir.name in have:
            return []
        if not (run_dir / DONE).is_file():
            cmd = ["--recipe", args.recipe, "--run-dir", str(run_dir), "--resume", "auto", *args.overrides]
            cmd += point_overrides(v, s, lr, k)
            if not train_once(cmd, run_dir, {"variant": v, "size": s, "lr": lr, "seed": k}, threads):
                return [run_dir.name]
        if (row := collect_run(run_dir)) is not None:
            budget = None if args.tokens else args.budget
            log.append({**row, "size": s, "seed_index": k, "budget": budget, "max_tokens": args.tokens})
        return []

    failed = run_chains([lambda p=p: train_point(*p) for p in points], args.jobs)
    if failed:
        print(f"[lr-sweep] {len(failed)} run(s) failed: {', '.join(failed)}; re-run the same command to resume")
        return 1
    found = {r["run"]: r for r in log.rows()}
    found.update({r["run"]: r for r in (collect_run(out / "runs" / rate_name(*p)) for p in points) if r})
    per_seed: dict[tuple[str, str, float], list[float]] = {}
    for v, s, lr, k in points:
        loss = found.get(rate_name(v, s, lr, k), {}).get("final_val_loss")
        if loss is None:
            raise StudyError(f"{rate_name(v, s, lr, k)} logged no val_loss. Fix: train.eval_every_steps > 0")
        per_seed.setdefault((v, s, lr), []).append(loss)
    losses = {key: float(np.mean(values)) for key, values in per_seed.items()}
    best = choose_rates(losses)
    rule = rate_rule(best)
    parametrization = cfg.model.fields.get("parametrization", "standard")
    for variant, check in transfer_check(best, parametrization, per_seed).items():
        rule[variant]["transfer"] = check
    for variant in rule:  # the model the rates were measured on: a plan on another model refuses them
        rule[variant]["model_overrides"] = model_overrides(args.overrides)
    (out / "lr.json").write_text(json.dumps(rule, indent=2))
    (out / "lr.md").write_text(lr_table(losses, rule))
    print(json.dumps({v: r["rates"] for v, r in rule.items()}, indent=2))
    print(
        f"wrote {out / 'lr.json'} and {out / 'lr.md'}; use it with: python -m studies.scaling "
        f"{'isoflop' if any('transfer' in r for r in rule.values()) else 'ladder'} --lr-from {out / 'lr.json'} ..."
    )
    return 0


def rate_check(
    rows: list[dict[str, Any]],
    budget: float,
    size: str,
    noise: dict[str, float],
    seeds: tuple[int, ...] = (0, 1),
    variants: list[str] | None = None,
) -> dict[str, dict]:
    """The rate at the longest horizon (docs/SCALING.md, "The rate at the longest horizon", stated before its
    runs): per variant, the seed-mean final loss of the cooled runs at `budget` and `size` at the transferred
    rate (the middle of three) and at 0.5x and 2x it, the same `seeds` at each. The rate **moves** if a
    neighbour's mean is below the middle's by more than 2 sigma / sqrt(2) (`noise`: the variant's pooled loss
    noise per run); a row repeated across row logs counts once (the first). The budget's two stages: a
    neighbour whose first seed lies 2 sigma or more above the middle's mean does not move it on that seed alone
    (the rest could move it only from 4.8 sigma below), so its other seeds need not train."""
    cells: dict[str, dict[float, dict[int, float]]] = {}
    for r in rows:
        if r.get("cooled") and r.get("size") == size and math.isclose(r.get("budget") or 0, budget, rel_tol=1e-6):
            cells.setdefault(r["variant"], {}).setdefault(float(r["lr"]), {}).setdefault(r["seed"], r["final_val_loss"])
    if variants is not None:
        absent = [v for v in variants if v not in cells]
        if absent:
            raise StudyError(f"no rows for {absent} at {budget:.3g} FLOPs, {size}. Fix: --variants of those trained")
        cells = {v: cells[v] for v in variants}
    out = {}
    for variant, by_rate in sorted(cells.items()):
        rates = sorted(by_rate)
        if len(rates) != 3 or not all(math.isclose(b / a, 2, rel_tol=1e-3) for a, b in zip(rates, rates[1:])):
            raise StudyError(
                f"{variant} at {budget:.3g} FLOPs, {size}: rates {[f'{x:g}' for x in rates]}, not x0.5, x1, x2 of one "
                "rate. Fix: the rows of the three --lr-factor runs and the grid's at that budget and size"
            )
        if variant not in noise:
            raise StudyError(f"no noise per run for {variant}. Fix: the grid's profiles.json (its `noise`)")
        x1, sigma = rates[1], noise[variant]
        if any(s not in by_rate[x1] for s in seeds):
            raise StudyError(f"{variant}: seeds missing at {x1:g} (x1). Fix: train them, or name the seeds there are")
        x1_mean = float(np.mean([by_rate[x1][s] for s in seeds]))
        used = {x1: list(seeds)}
        for lr in (rates[0], rates[2]):
            first = by_rate[lr].get(seeds[0])
            screened = first is not None and first >= x1_mean + 2 * sigma
            used[lr] = [seeds[0]] if screened else list(seeds)
            missing = [s for s in used[lr] if s not in by_rate[lr]]
            if missing:
                raise StudyError(
                    f"{variant}: seeds missing at {{'{lr:g}': {missing}}}. Fix: train them, or name the seeds there are"
                )
        mean = {lr: float(np.mean([by_rate[lr][s] for s in used[lr]])) for lr in rates}
        bar = 2 * sigma / math.sqrt(2)
        better = [lr for lr in (rates[0], rates[2]) if len(used[lr]) == len(seeds) and mean[lr] < mean[x1] - bar]
        best = min(better, key=mean.get) if better else x1
        factor = {rates[0]: 0.5, x1: 1.0, rates[2]: 2.0}[best]  # nominal: rows hold rates to 6 figures
        out[variant] = {"rates": rates, "mean": [mean[lr] for lr in rates], "bar": bar, "seeds": list(seeds),
                        "seeds_per_rate": [used[lr] for lr in rates], "moves": bool(better), "best": best,
                        "factor": factor}  # fmt: skip
    return out


def rate_check_table(result: dict[str, dict]) -> str:
    rows = [
        [v, ", ".join(f"{lr:.3g}" for lr in c["rates"]),
         ", ".join(f"{m:.3f}" + ("" if len(u) == len(c["seeds"]) else f" (seed {u[0]} only: 2 sigma above x1)")
                   for m, u in zip(c["mean"], c["seeds_per_rate"])),
         f"{c['bar']:.3f}", f"moves to x{c['factor']:g}" if c["moves"] else "stays at x1"]
        for v, c in result.items()
    ]  # fmt: skip
    return markdown_table(["variant", "rates (x0.5, x1, x2)", "seed-mean final loss", "bar", "rule"], rows) + "\n"
