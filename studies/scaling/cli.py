"""The scaling studies' command line (`python -m studies.scaling`): sweep, collect, fit, and the rest.

  python -m studies.scaling sweep   --recipe R --variants standard,frozen_qk,mixit --sizes tiny,xs,s \
                                 --tokens N [--seeds K] --out DIR [--slurm] [key=value ...]
  python -m studies.scaling collect --out DIR        # -> DIR/results.csv, DIR/results.md
  python -m studies.scaling fit     --out DIR        # -> DIR/fits.json, DIR/fits.md, DIR/loss_vs_params.png, DIR/loss_vs_flops.png
  python -m studies.scaling ladder  --recipe R --sizes n27k,...,n2000k --budgets 2.5,5,10,20 --cooldown 0.2 \
                                 --out DIR [--max-tokens T] [--more-seeds n27k=2,n214k=2] [--lr-from LR.json] [--slurm] [key=value ...]
  python -m studies.scaling lr-sweep --recipe R --sizes n27k,n90k,n214k --lrs 1e-3,...,1.6e-2 [--seeds K] --out DIR   # -> DIR/lr.json
  python -m studies.scaling isoflop --recipe R --grid 1e13=w32:w128,2e13=w32:w192 --lr-from LR.json --out DIR \
                                 [--more-seeds w64=3] [--plan-only] [key=value ...]   (studies/scaling/isoflop.py)
  python -m studies.scaling profiles --rows ROWS --out DIR   # -> DIR/profiles.json, profiles.md, isoflop.png, multiplier.png
  python -m studies.scaling band --rows ROWS --out DIR       # -> DIR/band.json, band.md: every analysis choice
  python -m studies.scaling transfer --rows LR_ROWS[,...] --out DIR   # -> DIR/transfer.json, transfer.md

A sweep point is one run directory DIR/runs/<variant>-<size>-s<seed>, trained by
`pretrain.train` with overrides; a finished point carries `sweep_done.json` and is
skipped, an interrupted one resumes from its last checkpoint (`--resume auto`).
`--slurm` writes DIR/sweep.sbatch, an array job running each point through
`launch.sh --slurm`, instead of running anything.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.cli import run_cli
from common.errors import StudyError
from data_pipeline.progress import progress_bar
from eval.report import markdown_table
from model import PRESETS
from pretrain.config import load_recipe

from ..rows import read_rows
from ..shared import check_variants, names, study_parser
from .band import band
from .band import report_markdown as band_markdown
from .band import to_json as band_json
from .fit import (
    JointFit,
    PowerLawFit,
    fit_joint,
    fit_variants,
    flops_curve,
    frontier,
    frontier_gap,
    held_out_check,
    plot_fits,
    plot_frontier,
)
from .isoflop import run_isoflop
from .ladder import LADDER, run_ladder, shape_overrides
from .lr import lr_sweep, rate_check, rate_check_table, sensitivity_table, transfer_sensitivity
from .profiles import analyse, plot_multipliers, plot_profiles, report_markdown, shift_rows, to_json
from .runs import (
    DONE,
    RowLog,
    collect_run,
    merge_share,
    recollect,
    run_name,
    tracker_overrides,
    train_once,
    write_array_script,
)


@dataclass
class Point:
    variant: str
    size: str
    seed: int

    @property
    def name(self) -> str:
        return run_name(self.variant, self.size, self.seed)

    def overrides(self, tokens: int | None) -> list[str]:
        shape = shape_overrides(self.size) if self.size in LADDER else [f"model.preset={self.size}"]
        out = [*shape, f"model.variant={self.variant}", f"seed={self.seed}", f"name={self.name}"]
        if tokens is not None:
            out += ["train.max_tokens=%d" % tokens, "train.max_steps=null"]
        return out


def plan(variants: list[str], sizes: list[str], seeds: int) -> list[Point]:
    check_variants(variants)
    for s in sizes:
        if s not in PRESETS and s not in LADDER:
            raise StudyError(f"unknown size {s!r}. Fix: choose from {list(PRESETS) + list(LADDER)}")
    if seeds < 1:
        raise StudyError(f"--seeds {seeds} must be >= 1. Fix: e.g. --seeds 3")
    return [Point(v, s, seed) for s in sizes for v in variants for seed in range(seeds)]


def train_args(recipe: str, point: Point, run_dir: Path, tokens: int | None, extra: list[str]) -> list[str]:
    return ["--recipe", recipe, "--run-dir", str(run_dir), "--resume", "auto", *point.overrides(tokens), *extra]


def sweep(args: argparse.Namespace) -> int:
    points = plan(args.variants.split(","), args.sizes.split(","), args.seeds)
    for p in points:  # a bad recipe or override fails here, before any point trains
        load_recipe(args.recipe, [*p.overrides(args.tokens), *args.overrides])
    out = Path(args.out)
    args.overrides += tracker_overrides(args.recipe, args.overrides, f"sweep:{out.name}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    plan_keys = ("recipe", "variants", "sizes", "seeds", "tokens", "overrides")
    (out / "sweep.json").write_text(json.dumps({k: getattr(args, k) for k in plan_keys}, indent=2))
    if args.slurm:
        lines = [
            shlex.join(train_args(args.recipe, p, out / "runs" / p.name, args.tokens, args.overrides)) for p in points
        ]
        script = out / "sweep.sbatch"
        write_array_script(script, "scaling-sweep", lines, out / "points.txt", "point")
        print(f"wrote {script} ({len(points)} points); submit with: sbatch {script}")
        return 0
    failed = []
    bar = progress_bar(points, desc="sweep", unit="run")
    for p in bar:
        run_dir = out / "runs" / p.name
        bar.set_postfix_str(p.name)
        if (run_dir / DONE).is_file():
            continue
        if not train_once(
            train_args(args.recipe, p, run_dir, args.tokens, args.overrides), run_dir, {"point": p.__dict__}
        ):
            failed.append(p.name)
            bar.write(f"[sweep] {p.name} failed; re-run the sweep to resume it")
    if failed:
        print(f"[sweep] {len(failed)} point(s) failed: {', '.join(failed)}")
        return 1
    print(f"[sweep] all {len(points)} points done; next: python -m studies.scaling collect --out {out}")
    return 0


# ---- collect ------------------------------------------------------------------------------
def collect(args: argparse.Namespace) -> list[dict[str, Any]]:
    """results.csv and results.md of every run under DIR/runs and, with --rows, every row of that log
    (a run directory's own row wins over its logged one)."""
    out = Path(args.out)
    runs = sorted(p for p in (out / "runs").glob("*") if p.is_dir())
    by_name = {r["run"]: r for r in RowLog(args.rows).rows()}
    by_name.update({r["run"]: r for r in (collect_run(p) for p in runs) if r is not None})
    rows = sorted(by_name.values(), key=lambda r: r["run"])
    if not rows:
        raise StudyError(
            f"no runs with metrics under {out / 'runs'}. Fix: run `python -m studies.scaling sweep --out {out}` first"
        )
    fields = list(dict.fromkeys(k for r in rows for k in r))  # per-set losses appear only where recorded
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.md").write_text(markdown_summary(rows))
    print(markdown_summary(rows))
    print(f"wrote {out / 'results.csv'} and {out / 'results.md'}")
    return rows


def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_summary(rows: list[dict[str, Any]]) -> str:
    """Mean and spread over seeds for each (variant, size)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:  # a cooldown branch is its own point (another token budget), not another seed
        groups.setdefault((r["variant"], r["size"], r.get("branch_step") or 0, r.get("cooled", True)), []).append(r)
    header = [
        "variant", "size", "branch at", "params", "trainable", "tokens", "PFLOP", "seeds",
        "final val loss (mean ± std)", "best val loss",
    ]  # fmt: skip
    table = []
    for (variant, size, branch, cooled), rs in sorted(
        groups.items(), key=lambda kv: (kv[1][0]["params"], kv[0][0], kv[0][2])
    ):
        where = f"{branch}" if branch else ("— (stable)" if not cooled else "—")
        vals = [r["final_val_loss"] for r in rs if r["final_val_loss"] is not None]
        best = [r["best_val_loss"] for r in rs if r["best_val_loss"] is not None]
        spread = f"{np.mean(vals):.3f} ± {np.std(vals, ddof=1) if len(vals) > 1 else 0.0:.3f}" if vals else "—"
        table.append(
            [
                variant, size, where, f"{rs[0]['params']:,}", f"{rs[0]['trainable_params']:,}",
                f"{int(np.mean([r['tokens'] for r in rs])):,}", f"{np.mean([r['flops'] for r in rs]) / 1e15:.4f}",
                len(rs), spread, _fmt(float(np.mean(best)) if best else None),
            ]
        )  # fmt: skip
    return markdown_table(header, table, align="llrrrrrrlr") + "\n"


# ---- fit ----------------------------------------------------------------------------------
# results.csv's columns that the fits read as numbers
NUMERIC = ("params", "non_embedding_params", "trainable_params", "flops", "final_val_loss", "best_val_loss", "tokens")


def fit(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    csv_path = out / "results.csv"
    if not csv_path.is_file():
        raise StudyError(f"{csv_path} not found. Fix: run `python -m studies.scaling collect --out {out}` first")
    with open(csv_path) as f:
        rows = [
            {k: float(v) if k in NUMERIC and v not in ("", "None") else v for k, v in r.items()}
            for r in csv.DictReader(f)
        ]
    y = args.metric
    report: dict[str, Any] = {}
    md = []
    by_n, by_c = power_law_points(rows)
    for x_key, label, png, points in (
        (args.param_kind, f"parameters ({args.param_kind})", "loss_vs_params.png", by_n),
        ("flops", "training FLOPs", "loss_vs_flops.png", by_c),
    ):
        fits = fit_variants(points, x_key, y)
        plot_fits(points, fits, x_key, y, out / png, label)
        report[x_key] = {v: (f.to_dict() if isinstance(f, PowerLawFit) else {"error": f}) for v, f in fits.items()}
        md += [
            f"### {y} vs {label}: L = E + A x^-alpha",
            "",
            "| variant | E | A | alpha | R² | RMSE | points | identified |",
            "|---|---|---|---|---:|---:|---:|---|",
        ]
        for v, f in fits.items():
            if isinstance(f, PowerLawFit):
                why = f.not_identified()
                md.append(
                    f"| {v} | {f.E:.3f} ± {f.E_err:.3f} | {f.A:.3g} ± {f.A_err:.2g} | "
                    f"{f.alpha:.3f} ± {f.alpha_err:.3f} | {f.r2:.4f} | {f.rmse:.4f} | {f.n_points} | "
                    + ("yes" if not why else "**not identified**: " + "; ".join(why))
                    + " |"
                )
            else:
                md.append(f"| {v} | — | — | — | — | — | — | {f} |")
        md.append("")
    report["joint"], joint_md, joint = joint_fits(rows, args.param_kind, y, args.boot)
    md += joint_md
    report["frontier"], frontier_md = frontier_gaps(rows, joint, args.param_kind, y, out / "gap_vs_flops.png")
    md += frontier_md + same_shape_gaps(rows, y)
    (out / "fits.json").write_text(json.dumps(report, indent=2))
    (out / "fits.md").write_text("\n".join(md))
    print("\n".join(md))
    pngs = ", ".join(
        str(out / p) for p in ("loss_vs_params.png", "loss_vs_flops.png", "gap_vs_flops.png") if (out / p).is_file()
    )
    print(f"wrote {out / 'fits.json'}, {out / 'fits.md'}, {pngs}")
    return report


def budgets(text: str) -> list[float]:
    """'3.52e14,1.408e15' -> [3.52e14, 1.408e15]: FLOP budgets, each positive."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive FLOPs (e.g. 3.52e14,1.408e15)"
        )
    return values


def write_profiles(args: argparse.Namespace) -> int:
    """The IsoFLOP analysis of a row log, as JSON, a markdown report and a figure."""
    again = read_rows(args.device_check) if args.device_check else None
    if args.device_check and not again:
        raise StudyError(
            f"--device-check {args.device_check} holds no rows. Fix: the rows of a device_isoflop.sh --check"
        )
    rows = read_rows(args.rows)
    result = analyse(
        shift_rows(rows, args.shift) if args.shift else rows, n_boot=args.boot, again=again, predict_at=args.predict
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = report_markdown(result)
    if args.shift:
        md = f"**Shifted rows** (`--shift {args.shift}`): a sensitivity check, not the measured grid.\n\n{md}"
    (out / "profiles.json").write_text(json.dumps(to_json(result), indent=2))
    (out / "profiles.md").write_text(md + "\n")
    pngs = [plot_profiles(result, out / "isoflop.png"), plot_multipliers(result, out / "multiplier.png")]
    print(md)
    print(f"wrote {out / 'profiles.json'}, {out / 'profiles.md'}, " + ", ".join(str(p) for p in pngs if p))
    return 0


def write_report(out_dir: str, stem: str, data: Any, md: str) -> None:
    """DIR/STEM.json and DIR/STEM.md of one analysis, the markdown printed, then where they went."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    (out / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {out / f'{stem}.json'}, {out / f'{stem}.md'}")


def write_band(args: argparse.Namespace) -> int:
    """The compute multiplier under every analysis choice (studies/scaling/band.py), as JSON and markdown."""
    result = band(read_rows(args.rows), n_boot=args.boot, draws=args.draws)
    write_report(args.out, "band", band_json(result), band_markdown(result) + "\n")
    return 0


def write_transfer(args: argparse.Namespace) -> int:
    """µP's transfer check again from lr-sweep rows, per seed and per window (studies/scaling/lr.py)."""
    checks = {}
    for path in args.rows.split(","):
        rows = read_rows(path)
        if not rows:
            raise StudyError(f"--rows {path} holds no rows. Fix: the row log of an lr-sweep at two widths")
        checks[Path(path).stem] = transfer_sensitivity(rows, draws=args.draws)
    if not any(checks.values()):
        raise StudyError(
            f"--rows {args.rows}: no variant swept at two widths. Fix: an lr-sweep's --sizes w32,w128 rows"
        )
    write_report(args.out, "transfer", checks, sensitivity_table(checks))
    return 0


def write_rate_check(args: argparse.Namespace) -> int:
    """The rate at the longest horizon from the grid's, the seeds' and the --lr-factor runs' rows."""
    missing = [p for p in args.rows.split(",") if not Path(p).is_file()]
    if missing:
        raise StudyError(f"--rows: no such row log {', '.join(missing)}. Fix: the paths of the runs' row logs")
    rows = [r for path in args.rows.split(",") for r in read_rows(path)]
    try:
        noise = {v: n["sigma"] for v, n in json.loads(Path(args.noise_from).read_text())["noise"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StudyError(f"--noise-from {args.noise_from}: {e}. Fix: the grid's profiles.json") from None
    result = rate_check(rows, args.budget, args.size, noise, variants=args.variants)
    write_report(args.out, "rate_check", result, rate_check_table(result))
    return 0


def power_law_points(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of L(N) and of L(C). A sweep's rows serve both. Of a ladder, only runs that ended at
    min_lr count (a stable run's loss is at the peak rate), and L(N) takes each (variant, size, seed)'s
    smallest budget (2.5 tokens per parameter by default, at every size), so its points are not an
    average over budgets; L(C) takes every budget."""
    if not any(str(r.get("branch_step") or "") not in ("", "None") for r in rows):
        return rows, rows
    cooled = [r for r in rows if str(r.get("cooled")) == "True"]
    first: dict[tuple, dict[str, Any]] = {}
    for r in cooled:
        key = (r["variant"], r["size"], r["seed"])
        if key not in first or float(r["tokens"]) < float(first[key]["tokens"]):
            first[key] = r
    return list(first.values()), cooled


def joint_fits(
    rows: list[dict[str, Any]], n_key: str, y: str, n_boot: int
) -> tuple[dict[str, Any], list[str], dict[str, JointFit]]:
    """Per variant: L(N, D) over the runs that ended on a decayed rate (branches, full schedules), its
    bootstrap intervals, and the held-out check (fit without the largest size, predict it)."""
    report: dict[str, Any] = {}
    fits: dict[str, JointFit] = {}
    md = [
        f"### {y}: L(N, D) = E + A N^-alpha + B D^-beta (N = {n_key}, D = tokens; 90% bootstrap intervals)",
        "",
        "| variant | E | A | alpha | B | beta | points | RMS log error | held-out size | held-out mean abs rel. error "
        "| identified |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for variant in sorted({r["variant"] for r in rows}):
        pts = cooled_rows(rows, variant, y)
        N, D, L = ([float(r[k]) for r in pts] for k in (n_key, "tokens", y))
        try:
            fit = fit_joint(N, D, L, n_boot=n_boot)
        except StudyError as e:
            report[variant] = {"error": str(e)}
            md.append(f"| {variant} | {e} |")
            continue
        fits[variant] = fit
        entry: dict[str, Any] = {"fit": fit.to_dict()}
        try:
            entry["held_out"] = check = held_out_check(N, D, L)
            held = f"{check['held_out_size']:,.0f} | {check['mean_abs_relative_error']:.2%}"
        except StudyError as e:
            entry["held_out"] = {"error": str(e)}
            held = "— | too few sizes"
        report[variant] = entry
        cell = {
            k: f"{getattr(fit, k):.3g} [{fit.intervals[k][0]:.3g}, {fit.intervals[k][1]:.3g}]" for k in fit.intervals
        }
        md.append(
            f"| {variant} | {cell.get('E', fit.E)} | {cell.get('A', fit.A)} | {cell.get('alpha', fit.alpha)} | "
            f"{cell.get('B', fit.B)} | {cell.get('beta', fit.beta)} | {fit.n_points} | {fit.rmse_log:.4f} | {held} | "
            + ("yes" if not fit.not_identified() else "**not identified**: " + "; ".join(fit.not_identified()))
            + " |"
        )
    return report, md + [""], fits


def cooled_rows(rows: list[dict[str, Any]], variant: str, y: str) -> list[dict[str, Any]]:
    return [
        r for r in rows if r["variant"] == variant and str(r.get("cooled")) == "True" and isinstance(r.get(y), float)
    ]


def frontier_gaps(
    rows: list[dict[str, Any]], fits: dict[str, JointFit], n_key: str, y: str, png: Path
) -> tuple[dict[str, Any], list[str]]:
    """Each variant's compute-optimal frontier under its joint fit, in its own training FLOPs (frozen
    weights' gradients excluded), and its gap to standard's at equal compute with 90% bootstrap bands,
    over the compute range the ladder ran; a plot of both."""
    unidentified = {v: f.not_identified() for v, f in fits.items() if f.not_identified()}
    fits = {v: f for v, f in fits.items() if v not in unidentified}
    skipped = [f"(no frontier from {v}'s fit: not identified, {'; '.join(r)})" for v, r in unidentified.items()]
    if "standard" not in fits or len(fits) < 2:
        return {}, [*skipped, "(no frontier gap: it needs identified joint fits of standard and another variant)", ""]
    curves, grids, spans, max_tokens = {}, {}, [], {}
    for v in fits:
        pts = cooled_rows(rows, v, y)
        max_tokens[v] = max(float(r["tokens"]) for r in pts)
        N = np.array([float(r[n_key]) for r in pts])
        curves[v] = flops_curve(N, [float(r["flops"]) / float(r["tokens"]) for r in pts])
        grids[v] = np.geomspace(N.min(), N.max(), 240)
        spans += [float(r["flops"]) for r in pts]
    C = np.geomspace(min(spans), max(spans), 41)
    report: dict[str, Any] = {}
    for v in fits:
        f = frontier(fits[v].params(), curves[v], C, grids[v])
        report[v] = {"frontier": {k: f[k].tolist() for k in f}}
        if v != "standard":
            g = frontier_gap(fits[v], fits["standard"], curves[v], curves["standard"], C, grids[v], grids["standard"])
            report[v]["gap_to_standard"] = {k: g[k].tolist() for k in g}
    plot_frontier(rows, report, y, png)
    picks = [0, 10, 20, 30, 40]
    md = [
        "### Frontier gap to standard at equal training FLOPs (each variant's own FLOPs; 90% bootstrap band)",
        "",
        "| variant | " + " | ".join(f"C = {C[i]:.2e}" for i in picks) + " |",
        "|---|" + "---|" * len(picks),
    ]
    for v, entry in report.items():
        if g := entry.get("gap_to_standard"):
            cells = [f"{g['gap'][i]:+.3f} [{g['low'][i]:+.3f}, {g['high'][i]:+.3f}]" for i in picks]
            md.append(f"| {v} | " + " | ".join(cells) + " |")
    md.append("")
    md.append("| variant | " + " | ".join(f"N* / D* at C = {C[i]:.2e}" for i in picks) + " |")
    md.append("|---|" + "---|" * len(picks))
    for v, entry in report.items():
        N, D, grid = entry["frontier"]["N"], entry["frontier"]["D"], grids[v]
        cells = [
            f"{N[i]:,.0f} / {D[i]:.2g}"
            + (" (edge)" if N[i] in (grid[0], grid[-1]) else "")
            + (" (D beyond the data)" if D[i] > max_tokens[v] else "")
            for i in picks
        ]
        md.append(f"| {v} | " + " | ".join(cells) + " |")
    md.append(
        "(N* / D*: the frontier's size and tokens. edge: the optimum lies at the ladder's smallest or largest "
        "size, so it may lie beyond it; D beyond the data: more tokens than any run of that variant saw, so "
        "the law is extrapolated there.)"
    )
    return report, [*skipped, *md, ""]


def same_shape_gaps(rows: list[dict[str, Any]], y: str) -> list[str]:
    """The fit-free comparison: at each ladder shape and token budget, each variant's loss less
    standard's (mean over seeds, with the seeds' spread), and its FLOPs as a fraction of standard's."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if str(r.get("cooled")) == "True" and isinstance(r.get(y), float):
            groups.setdefault((r["size"], int(float(r["tokens"])), r["variant"]), []).append(r)
    md = [
        f"### {y} at the same shape and tokens: variant less standard (mean ± std over seeds)",
        "",
    ]
    table = []
    for (size, tokens, v), rs in sorted(groups.items(), key=lambda kv: (float(kv[1][0]["flops"]), kv[0])):
        base = groups.get((size, tokens, "standard"))
        if v == "standard" or not base:
            continue
        ls, lb = [r[y] for r in rs], [r[y] for r in base]
        spread = math.sqrt((np.var(ls, ddof=1) if len(ls) > 1 else 0) + (np.var(lb, ddof=1) if len(lb) > 1 else 0))
        table.append(
            [
                size, f"{tokens:,}", f"{np.mean(lb):.3f}", v, f"{np.mean(ls) - np.mean(lb):+.3f} ± {spread:.3f}",
                f"{np.mean([float(r['flops']) for r in rs]) / np.mean([float(r['flops']) for r in base]):.3f}",
                f"{len(ls)} / {len(lb)}",
            ]
        )  # fmt: skip
    header = ["size", "tokens", "standard", "variant", "variant less standard", "variant FLOPs / standard's", "seeds"]
    md.append(markdown_table(header, table, align="lrrlrrr"))
    return md + [""]


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.scaling", __doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def trainer(name: str, what: str, sizes: str | None, sizes_help: str | None = None) -> argparse.ArgumentParser:
        """A subcommand that trains: a recipe, variants and sizes (None: it has its own), an out-dir, and overrides."""
        p = sub.add_parser(name, help=what)
        p.add_argument("--recipe", required=True)
        p.add_argument("--variants", default="standard,frozen_qk,mixit")
        if sizes is not None:
            p.add_argument("--sizes", default=sizes, help=sizes_help)
        p.add_argument("--out", required=True)
        p.add_argument("overrides", nargs="*", help="extra recipe overrides, key=value")
        return p

    sw = trainer("sweep", "train every (variant, size, seed) point", "tiny,xs,s")
    sw.add_argument("--tokens", type=int, help="training tokens per point (default: the recipe's)")
    sw.add_argument("--seeds", type=int, default=1)
    sw.add_argument("--slurm", action="store_true", help="write a Slurm array script instead of running")
    co = sub.add_parser("collect", help="tabulate the finished runs")
    co.add_argument("--out", required=True)
    co.add_argument("--rows", help="a row log of ladder/lr-sweep: its runs count too")
    fi = sub.add_parser("fit", help="fit L(N) and L(C) per variant and plot")
    fi.add_argument("--out", required=True)
    fi.add_argument("--metric", default="final_val_loss", choices=["final_val_loss", "best_val_loss"])
    fi.add_argument(
        "--param-kind", default="non_embedding_params", choices=["params", "non_embedding_params", "trainable_params"]
    )
    fi.add_argument("--boot", type=int, default=200, help="bootstrap resamples of the joint fit L(N, D)")
    la = trainer(
        "ladder",
        "stable runs and their cooldown branches (studies/scaling/ladder.py)",
        ",".join(LADDER),
        f"ladder sizes: {', '.join(LADDER)}",
    )
    la.add_argument("--budgets", default="2.5,5,10,20", help="token budgets, tokens per non-embedding parameter")
    la.add_argument("--cooldown", type=float, default=0.2, help="a branch decays over this fraction of its step")
    la.add_argument("--max-tokens", type=int, help="drop budgets above this many tokens")
    la.add_argument("--seeds", type=int, default=1)
    la.add_argument("--more-seeds", default="", help="SIZE=K,...: K seeds at these sizes (the noise floor)")
    la.add_argument(
        "--batch-sequences", default="", help="SIZE=B,...: global batch (sequences) per size; else the recipe's"
    )
    la.add_argument("--lr-from", help="lr.json of lr-sweep: a rate per variant and size")
    la.add_argument("--slurm", action="store_true", help="write Slurm scripts instead of running")
    lr = trainer(
        "lr-sweep",
        "a rate grid per variant at the smaller sizes, and the rule (studies/scaling/lr.py)",
        "n27k,n90k,n214k",
    )
    lr.add_argument(
        "--lrs", default="1e-3,2e-3,4e-3,8e-3,1.6e-2", help="the grid (a best rate at its edge is an error)"
    )
    lr.add_argument("--budget", type=float, default=5.0, help="tokens per non-embedding parameter of each run")
    lr.add_argument("--extra-lrs", help="VARIANT=LR:LR,...: more rates for one variant (its best at an edge)")
    lr.add_argument("--tokens", type=int, help="tokens of every run instead of --budget (a µP transfer check)")
    lr.add_argument("--min-lr-fraction", type=float, help="decay to this fraction of each run's rate (else min_lr)")
    lr.add_argument("--batch-sequences", default="", help="SIZE=B,...: the ladder's global batch per size")
    lr.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="seeds per point (seed i: the recipe's + i); >= 2 gives the transfer an interval",
    )
    iso = trainer("isoflop", "IsoFLOP profiles at fixed batch under µP (studies/scaling/isoflop.py)", None)
    iso.add_argument("--grid", required=True, help="BUDGET=FIRST:LAST,...: FLOPs and the widths each holds")
    iso.add_argument(
        "--standard-grid", help="BUDGET=FIRST:LAST,...: budgets standard alone trains too (its curve at lower loss)"
    )
    iso.add_argument(
        "--lr-from",
        help="PATH[,VARIANT=PATH...]: lr.json of µP lr-sweeps whose transfer check held, one rate per variant",
    )
    iso.add_argument(
        "--per-width-rates",
        default="",
        help="VARIANT,...: variants whose transfer check failed, each width at a rate log-linear in log width "
        "through the check's two optima",
    )
    iso.add_argument(
        "--variant-override",
        action="append",
        default=[],
        help="VARIANT:KEY=VALUE, repeatable: an override for that variant's runs alone (its rate's lr.json must match)",
    )
    iso.add_argument("--min-lr-fraction", type=float, default=0.1, help="every run decays to this share of its rate")
    iso.add_argument("--cooldown", type=float, default=0.2, help="a branch decays over this fraction of its step")
    iso.add_argument("--seeds", type=int, default=1)
    iso.add_argument(
        "--more-seeds",
        default="",
        help="SIZE=K[@FLOPS],...: K seeds at these widths (minima and neighbours); the seeds beyond --seeds stop at FLOPS",
    )
    iso.add_argument("--min-steps", type=int, default=500, help="the fewest optimizer steps a run may take")
    iso.add_argument("--max-epochs", type=float, default=4.0, help="the most passes over the training shards")
    iso.add_argument(
        "--chains", help="VARIANT-SIZE[-sSEED],...: train only these chains of the grid (a grid split across machines)"
    )
    iso.add_argument(
        "--lr-factor",
        type=float,
        default=1.0,
        help="every run at this multiple of its transferred rate (the rate check; its own --rows and --out)",
    )
    iso.add_argument("--plan-only", action="store_true", help="print the runs and their FLOPs, train nothing")
    iso.add_argument("--slurm", action="store_true", help="write Slurm scripts instead of running")
    pr = sub.add_parser("profiles", help="IsoFLOP optima, laws, compute multipliers (studies/scaling/profiles.py)")
    pr.add_argument("--rows", required=True, help="the isoflop command's row log")
    pr.add_argument("--out", required=True)
    pr.add_argument("--boot", type=int, default=1000, help="bootstrap draws")
    pr.add_argument("--device-check", help="rows of runs of the grid trained again on another device")
    pr.add_argument("--shift", help="VARIANT@DEVICE=NATS,...: move those rows' losses first (a sensitivity check)")
    pr.add_argument(
        "--predict", type=budgets, default=[], help="BUDGET,...: predict each variant's L*, N* and multiplier there"
    )
    bd = sub.add_parser(
        "band", help="the compute multiplier under every analysis choice, beside its interval (studies/scaling/band.py)"
    )
    bd.add_argument("--rows", required=True, help="the isoflop command's row log")
    bd.add_argument("--out", required=True)
    bd.add_argument("--boot", type=int, default=1000, help="bootstrap draws of the profiles (approach 2)")
    bd.add_argument("--draws", type=int, default=200, help="parametric bootstrap draws of the joint fits (approach 3)")
    tr = sub.add_parser(
        "transfer", help="µP's transfer check again per seed and per window of the best rate (studies/scaling/lr.py)"
    )
    tr.add_argument("--rows", required=True, help="PATH[,PATH...]: lr-sweep row logs (each its own models)")
    tr.add_argument("--out", required=True)
    tr.add_argument("--draws", type=int, default=1000, help="bootstrap draws over seeds")
    rk = sub.add_parser("rate-check", help="the rate at the longest horizon: x0.5, x1, x2 (studies/scaling/lr.py)")
    rk.add_argument("--rows", required=True, help="PATH[,PATH...]: the grid's, the seeds' and the --lr-factor rows")
    rk.add_argument("--budget", type=float, default=8.8e13)
    rk.add_argument("--size", default="w96")
    rk.add_argument("--noise-from", required=True, help="the grid's profiles.json (its per-run noise per variant)")
    rk.add_argument("--variants", type=names, help="only these (default: every variant with rows at the size)")
    rk.add_argument("--out", required=True)
    rc = sub.add_parser("recollect", help="add the fields rows written by older code lack, from their run dirs")
    rc.add_argument("--rows", required=True, help="a study's row log (rewritten in place, under its lock)")
    rc.add_argument("--runs", required=True, help="the study's runs/ directory")
    mg = sub.add_parser("merge", help="add another machine's share of a grid to its row log, whole chains only")
    mg.add_argument("--rows", required=True, help="the grid's row log (appended under its lock)")
    mg.add_argument("--share", required=True, help="the row log the other machine's isoflop --chains wrote")
    mg.add_argument("--chains", help="VARIANT-SIZE-sSEED,...: only these chains of the share")
    mg.add_argument("--repeats", help="where the share's runs the grid already holds go (a device check's row log)")
    for p in (la, lr, iso):
        p.add_argument("--jobs", type=int, default=1, help="runs side by side (each with cores/jobs threads)")
        p.add_argument("--rows", help="JSON-lines log: a row per finished run; runs in it are skipped")
    args = ap.parse_args(argv)

    def body() -> int:
        if args.cmd == "sweep":
            return sweep(args)
        if args.cmd == "ladder":
            return run_ladder(args)
        if args.cmd == "lr-sweep":
            return lr_sweep(args)
        if args.cmd == "isoflop":
            return run_isoflop(args)
        if args.cmd == "profiles":
            return write_profiles(args)
        if args.cmd == "band":
            return write_band(args)
        if args.cmd == "transfer":
            return write_transfer(args)
        if args.cmd == "rate-check":
            return write_rate_check(args)
        if args.cmd == "recollect":
            given, gone = recollect(Path(args.rows), Path(args.runs))
            print(f"{args.rows}: {given} row(s) given new fields; {gone} without a run dir under {args.runs}")
            return 0
        if args.cmd == "merge":
            taken, left = merge_share(
                Path(args.rows),
                Path(args.share),
                args.chains.split(",") if args.chains else None,
                Path(args.repeats) if args.repeats else None,
            )
            print(
                f"{args.rows}: took the chains {', '.join(taken) or 'none'}; left out (unfinished): {', '.join(left) or 'none'}"
            )
            return 0
        if args.cmd == "collect":
            collect(args)
        else:
            fit(args)
        return 0

    return run_cli(body)
