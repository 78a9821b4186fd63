"""Scaling studies of the variants: sweep, collect, fit.

  python -m studies.scaling sweep   --recipe R --variants standard,frozen_qk,mixit --sizes tiny,xs,s \
                                 --tokens N [--seeds K] --out DIR [--slurm] [key=value ...]
  python -m studies.scaling collect --out DIR        # -> DIR/results.csv, DIR/results.md
  python -m studies.scaling fit     --out DIR        # -> DIR/fits.json, DIR/fits.md, DIR/loss_vs_params.png, DIR/loss_vs_flops.png

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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.cli import CliParser, run_cli
from common.constants import REPO_ROOT
from common.errors import StudyError
from data_pipeline.progress import progress_bar
from model import PRESETS, VARIANTS, ModelConfig, build_model, param_count
from model.flops import flops_per_token
from pretrain.config import load_recipe
from pretrain.run_dir import read_config

from .scaling_fit import PowerLawFit, fit_variants, plot_fits

DONE = "sweep_done.json"


@dataclass
class Point:
    variant: str
    size: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}-{self.size}-s{self.seed}"

    def overrides(self, tokens: int | None) -> list[str]:
        out = [f"model.preset={self.size}", f"model.variant={self.variant}", f"seed={self.seed}", f"name={self.name}"]
        if tokens is not None:
            out += ["train.max_tokens=%d" % tokens, "train.max_steps=null"]
        return out


def branch_overrides(step: int, fraction: float) -> list[str]:
    """Recipe overrides of a cooldown branch resumed from a stable run's checkpoint at `step`: the wsd
    schedule's 1-sqrt decay to min_lr over round(fraction * step) steps (at least one)."""
    if step < 1 or not 0 < fraction <= 1:
        raise StudyError(f"a cooldown branch needs a step >= 1 and a fraction in (0, 1], got {step} and {fraction}")
    decay = max(1, round(fraction * step))
    return ["optim.decay=wsd", f"optim.decay_start={step}", f"train.max_steps={step + decay}", "train.max_tokens=null"]


def plan(variants: list[str], sizes: list[str], seeds: int) -> list[Point]:
    for v in variants:
        if v not in VARIANTS:
            raise StudyError(f"unknown variant {v!r}. Fix: choose from {sorted(VARIANTS)}")
    for s in sizes:
        if s not in PRESETS:
            raise StudyError(f"unknown size {s!r}. Fix: choose from {list(PRESETS)}")
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
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(
        json.dumps(
            {
                "recipe": args.recipe,
                "variants": args.variants,
                "sizes": args.sizes,
                "seeds": args.seeds,
                "tokens": args.tokens,
                "overrides": args.overrides,
            },
            indent=2,
        )
    )
    if args.slurm:
        lines = [
            shlex.join(train_args(args.recipe, p, out / "runs" / p.name, args.tokens, args.overrides)) for p in points
        ]
        (out / "points.txt").write_text("\n".join(lines) + "\n")
        script = out / "sweep.sbatch"
        script.write_text(f"""#!/bin/bash
#SBATCH --job-name=scaling-sweep
#SBATCH --array=0-{len(points) - 1}
#SBATCH --output={out.resolve()}/runs/slurm-%A_%a.out
# Adjust --nodes/--gpus-per-node/--time for your cluster. Each array task trains one point.
set -euo pipefail
cd {REPO_ROOT}
ARGS=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {(out / "points.txt").resolve()})
eval "set -- $ARGS"
./launch.sh --slurm -- "$@"
""")
        print(f"wrote {script} ({len(points)} points); submit with: sbatch {script}")
        return 0
    failed = []
    bar = progress_bar(points, desc="sweep", unit="run")
    for p in bar:
        run_dir = out / "runs" / p.name
        bar.set_postfix_str(p.name)
        if (run_dir / DONE).is_file():
            continue
        cmd = [
            sys.executable,
            "-m",
            "pretrain.train",
            *train_args(args.recipe, p, run_dir, args.tokens, args.overrides),
        ]
        start = time.time()
        proc = subprocess.run(cmd, cwd=REPO_ROOT)
        if proc.returncode != 0:
            failed.append(p.name)
            bar.write(f"[sweep] {p.name} failed (exit {proc.returncode}); re-run the sweep to resume it")
            continue
        (run_dir / DONE).write_text(json.dumps({"seconds": time.time() - start, "point": p.__dict__}))
    if failed:
        print(f"[sweep] {len(failed)} point(s) failed: {', '.join(failed)}")
        return 1
    print(f"[sweep] all {len(points)} points done; next: python -m studies.scaling collect --out {out}")
    return 0


# ---- collect ------------------------------------------------------------------------------
def collect_run(run_dir: Path) -> dict[str, Any] | None:
    """One row per finished run: losses, sizes, tokens, FLOPs (schedule-aware), wall time."""

    run, metrics_file = read_config(run_dir), run_dir / "metrics.jsonl"
    if run is None or not metrics_file.is_file():
        return None
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    seq_len = int(run["train"]["seq_len"])
    mcfg = ModelConfig.from_dict(run["model"])  # config.yaml records the resolved model
    train_rows = [r for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    last = train_rows[-1] if train_rows else rows[-1]
    tokens = int(last.get("tokens_seen", 0))
    steps = int(last.get("step", 0))
    tokens_per_step = tokens / steps if steps else 0.0
    # FLOPs with the freeze schedule: each step costs the rate of the groups frozen at that step.
    bounds = [0] + [b for b in mcfg.schedule_boundaries() if b < steps] + [steps]
    flops = sum(
        (b1 - b0) * tokens_per_step * flops_per_token(mcfg, seq_len, step=b0)["train"]
        for b0, b1 in zip(bounds[:-1], bounds[1:])
    )
    counts = param_count(mcfg)
    with torch.device("meta"):
        trainable = sum(p.numel() for p in build_model(mcfg).parameters() if p.requires_grad)
    done = run_dir / DONE
    wall = json.loads(done.read_text())["seconds"] if done.is_file() else None
    parts = run_dir.name.rsplit("-", 2)  # <variant>-<size>-s<seed>
    size = parts[1] if len(parts) == 3 else "custom"
    return {
        "run": run_dir.name,
        "variant": mcfg.variant,
        "size": size,
        "seed": run.get("seed"),
        "params": counts["total"],
        "non_embedding_params": counts["non_embedding"],
        "trainable_params": trainable,
        "steps": steps,
        "tokens": tokens,
        "flops": flops,
        "final_train_loss": last.get("loss"),
        "final_val_loss": val[-1][1] if val else None,
        "best_val_loss": min(v for _, v in val) if val else None,
        "wall_seconds": wall,
        "finished": done.is_file(),
    }


def collect(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = Path(args.out)
    runs = sorted(p for p in (out / "runs").glob("*") if p.is_dir())
    rows = [r for r in (collect_run(p) for p in runs) if r is not None]
    if not rows:
        raise StudyError(
            f"no runs with metrics under {out / 'runs'}. Fix: run `python -m studies.scaling sweep --out {out}` first"
        )
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
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
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["size"]), []).append(r)
    lines = [
        "| variant | size | params | trainable | tokens | PFLOP | seeds | final val loss (mean ± std) | best val loss |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for (variant, size), rs in sorted(groups.items(), key=lambda kv: (kv[1][0]["params"], kv[0][0])):
        vals = [r["final_val_loss"] for r in rs if r["final_val_loss"] is not None]
        best = [r["best_val_loss"] for r in rs if r["best_val_loss"] is not None]
        spread = f"{np.mean(vals):.3f} ± {np.std(vals, ddof=1) if len(vals) > 1 else 0.0:.3f}" if vals else "—"
        lines.append(
            f"| {variant} | {size} | {rs[0]['params']:,} | {rs[0]['trainable_params']:,} | "
            f"{int(np.mean([r['tokens'] for r in rs])):,} | {np.mean([r['flops'] for r in rs]) / 1e15:.4f} | "
            f"{len(rs)} | {spread} | {_fmt(float(np.mean(best)) if best else None)} |"
        )
    return "\n".join(lines) + "\n"


# ---- fit ----------------------------------------------------------------------------------
def fit(args: argparse.Namespace) -> dict[str, Any]:

    out = Path(args.out)
    csv_path = out / "results.csv"
    if not csv_path.is_file():
        raise StudyError(f"{csv_path} not found. Fix: run `python -m studies.scaling collect --out {out}` first")
    with open(csv_path) as f:
        rows = [
            {
                k: (
                    float(v)
                    if k
                    in (
                        "params",
                        "non_embedding_params",
                        "trainable_params",
                        "flops",
                        "final_val_loss",
                        "best_val_loss",
                    )
                    and v not in ("", "None")
                    else v
                )
                for k, v in r.items()
            }
            for r in csv.DictReader(f)
        ]
    y = args.metric
    report: dict[str, Any] = {}
    md = []
    for x_key, label, png in (
        (args.param_kind, f"parameters ({args.param_kind})", "loss_vs_params.png"),
        ("flops", "training FLOPs", "loss_vs_flops.png"),
    ):
        fits = fit_variants(rows, x_key, y)
        plot_fits(rows, fits, x_key, y, out / png, label)
        report[x_key] = {v: (f.to_dict() if isinstance(f, PowerLawFit) else {"error": f}) for v, f in fits.items()}
        md += [
            f"### {y} vs {label}: L = E + A x^-alpha",
            "",
            "| variant | E | A | alpha | R² | RMSE | points |",
            "|---|---|---|---|---:|---:|---:|",
        ]
        for v, f in fits.items():
            if isinstance(f, PowerLawFit):
                md.append(
                    f"| {v} | {f.E:.3f} ± {f.E_err:.3f} | {f.A:.3g} ± {f.A_err:.2g} | "
                    f"{f.alpha:.3f} ± {f.alpha_err:.3f} | {f.r2:.4f} | {f.rmse:.4f} | {f.n_points} |"
                )
            else:
                md.append(f"| {v} | — | — | — | — | — | {f} |")
        md.append("")
    (out / "fits.json").write_text(json.dumps(report, indent=2))
    (out / "fits.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"wrote {out / 'fits.json'}, {out / 'fits.md'}, {out / 'loss_vs_params.png'}, {out / 'loss_vs_flops.png'}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(
        prog="python -m studies.scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="train every (variant, size, seed) point")
    sw.add_argument("--recipe", required=True)
    sw.add_argument("--variants", default="standard,frozen_qk,mixit")
    sw.add_argument("--sizes", default="tiny,xs,s")
    sw.add_argument("--tokens", type=int, default=None, help="training tokens per point (default: the recipe's)")
    sw.add_argument("--seeds", type=int, default=1)
    sw.add_argument("--out", required=True)
    sw.add_argument("--slurm", action="store_true", help="write a Slurm array script instead of running")
    sw.add_argument("overrides", nargs="*", help="extra recipe overrides, key=value")
    co = sub.add_parser("collect", help="tabulate the finished runs")
    co.add_argument("--out", required=True)
    fi = sub.add_parser("fit", help="fit L(N) and L(C) per variant and plot")
    fi.add_argument("--out", required=True)
    fi.add_argument("--metric", default="final_val_loss", choices=["final_val_loss", "best_val_loss"])
    fi.add_argument(
        "--param-kind", default="non_embedding_params", choices=["params", "non_embedding_params", "trainable_params"]
    )
    args = ap.parse_args(argv)

    def body() -> int:
        if args.cmd == "sweep":
            return sweep(args)
        if args.cmd == "collect":
            collect(args)
        else:
            fit(args)
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
