"""The paper's comparison as a recipe set; its `demo` suite is the README's main command.

Trains every (task, variant) of a suite with the DeepSpeed trainer (one process per run,
two at a time on two CPU cores, one at a time on a GPU), evaluates each final checkpoint
with the eval harness (synthetic tasks: accuracy at the positions the task scores; text:
held-out loss in nats per byte), and prints a table next to the paper's numbers, one line
saying whether the paper's qualitative result holds, and the path of a plot. No
downloads. Re-running resumes and skips finished runs.

    python -m studies.demo                                  # suite `demo`: 2 tasks x 3 variants, ~10 min on 2 cores
    python -m studies.demo --suite paper --out outputs/paper   # 7 tasks x 4 variants (docs/RESULTS.md)
    python -m studies.demo --suite paper --seeds 3          # every cell 3 times: mean ± std per cell
    python -m studies.demo --suite paper --tasks khop_dense --variants standard,mixit   # one row, two variants

With `--seeds N`, seed i (0-based) trains with the recipe's seed + i (model init, data order and the
task's own draw) and MixiT matrices of seed i, into OUT/runs/<task>-<variant>-s<i> (seed 0: the
single-seed run dir, so earlier outputs are reused), and is evaluated with the same task seed. Cells
show mean ± std over the seeds; results.json keeps every seed's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.cli import run_cli
from common.errors import StudyError
from data_pipeline.progress import progress_bar
from eval.report import markdown_table, new_figure, save_figure
from eval.run import EvalOptions, evaluate_checkpoint
from pretrain.config import load_recipe
from pretrain.metrics import last_step, read_metrics

from .retrieval import mode_guess_exact
from .scaling.runs import DONE, run_chains, threads_per_job, train_once
from .shared import check_variants, label_axes, names, seed_overrides, study_parser
from .spread import Spread


@dataclass(frozen=True)
class DemoTask:
    name: str  # data_pipeline synthetic task, or "text" (held-out LM loss from the run)
    recipe: str
    label: str
    task_args: dict
    chance: float  # accuracy of a model that ignores the context (synthetic tasks)

    @property
    def is_text(self) -> bool:
        return self.name == "text"


MODADD = DemoTask(
    "modular_addition", "recipes/demo_modadd.yaml", "modular addition (held-out pairs)", {"p": 31}, 1 / 31
)
KV = DemoTask(
    "kv_retrieval", "recipes/demo_kv.yaml", "kv retrieval (value)", {"n_pairs": 4, "n_keys": 8, "n_values": 8}, 1 / 8
)
SUITES = {
    "demo": {"tasks": (MODADD, KV), "variants": "standard,frozen_qk,mixit"},
    "paper": {
        "tasks": (
            DemoTask(
                "addition", "recipes/paper_addition.yaml", "2-digit addition (answer digits)", {"n_digits": 2}, 0.1
            ),
            MODADD,
            DemoTask("dyck", "recipes/paper_dyck.yaml", "Dyck-1 (balanced?)", {}, 0.5),
            DemoTask(
                "memorization",
                "recipes/paper_memorization.yaml",
                "memorization (random labels)",
                {"n1": 32, "n2": 32, "n_labels": 16},
                1 / 16,
            ),
            KV,
            DemoTask(
                "khop_dense",
                "recipes/paper_khop_dense.yaml",
                "2-hop induction (answered at every position)",
                {"k": 2, "length": 24, "n_symbols": 8},
                1 / 8,
            ),
            DemoTask("text", "recipes/paper_wikitext2.yaml", "WikiText-2 bytes (val loss, nats/byte)", {}, 0.0),
        ),
        "variants": "standard,frozen_qk,frozen_mlp,mixit",
    },
}
ARITHMETIC, RETRIEVAL = "modular_addition", "kv_retrieval"
# Guessing one of the values present in the context (1 to 4 pairs, uniformly): what a model
# that cannot address by content can still reach on this retrieval task.
# The in-context guess G of the kv task (studies/retrieval.py, exact): the most frequent value in the context,
# the best a model that reads values but not their keys can do.
CONTEXT_GUESS = mode_guess_exact(KV.task_args["n_pairs"], KV.task_args["n_values"])
# The paper's numbers (VARIANTS.md), for shape rather than decimals.
PAPER = {
    "modular_addition": {"standard": "solved", "frozen_qk": "solved", "mixit": "matches standard"},
    "addition": {"standard": "solved", "mixit": "matches standard"},
    "dyck": {"standard": "solved", "mixit": "matches standard"},
    "memorization": {
        "standard": "2.98 bit/param",
        "frozen_qk": "2.25 bit/param",
        "mixit": "2.18 bit/param",
        "frozen_mlp": "1.13 bit/param",
    },
    "kv_retrieval": {"standard": "100%", "frozen_qk": "97.0%", "mixit": "11.2%"},
    "khop_dense": {"standard": "99.99% (16-hop)", "frozen_qk": "96.7%", "mixit": "48.6%"},
    "text": {"standard": "2.78 (WT-103, nats/token)", "frozen_qk": "3.07", "mixit": "3.73"},
}


def _run_dir(out: Path, task: DemoTask, variant: str, seed_index: int = 0) -> Path:
    return out / "runs" / (f"{task.name}-{variant}" + (f"-s{seed_index}" if seed_index else ""))


def _recipe_seed(task: DemoTask) -> int:
    return load_recipe(task.recipe).seed


def train_all(
    out: Path, tasks, variants: list[str], scale: float, parallel: int, seeds: int = 1
) -> dict[tuple[str, str, int], Path]:
    """Train every (task, variant, seed index) as its own process, `parallel` at a time (the studies'
    launcher, studies/scaling/runs.py), with one progress bar over their steps."""
    jobs = [(t, v, i) for i in range(seeds) for t in tasks for v in variants]
    total = {(t.name, v): max(1, int(load_recipe(t.recipe).max_steps * scale)) for t in tasks for v in variants}
    running: set[str] = set()  # labels of the runs in progress, shared with the progress watcher
    running_lock = threading.Lock()
    threads = threads_per_job(parallel)

    def train_job(task: DemoTask, variant: str, i: int) -> list[str]:
        run_dir = _run_dir(out, task, variant, i)
        if (run_dir / DONE).is_file():
            return []
        run_dir.mkdir(parents=True, exist_ok=True)
        args = ["--recipe", task.recipe, "--run-dir", str(run_dir), "--resume", "auto"]
        args += [f"model.variant={variant}", f"train.max_steps={total[(task.name, variant)]}"]
        if i:  # a new draw of everything random: init, data order, the task, MixiT's fixed matrices
            args += seed_overrides(_recipe_seed(task), i)
        label = f"{task.name}/{variant}" + (f"/s{i}" if i else "")
        with running_lock:
            running.add(label)
        ok = train_once(args, run_dir, {"task": task.name, "variant": variant}, threads, log=run_dir / "train.log")
        with running_lock:
            running.discard(label)
        return [] if ok else [f"{label} (see {run_dir / 'train.log'})"]

    bar = progress_bar(
        total=sum(total[(t.name, v)] for t, v, _ in jobs), desc="training", unit="step", dynamic_ncols=True
    )
    finished = threading.Event()

    def refresh() -> None:
        bar.n = sum(min(last_step(_run_dir(out, t, v, i)), total[(t.name, v)]) for t, v, i in jobs)
        with running_lock:
            labels = sorted(running)
        bar.set_postfix_str(", ".join(labels) or "done")

    def watch() -> None:
        while not finished.wait(2.0):
            refresh()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        failed = run_chains([lambda job=job: train_job(*job) for job in jobs], parallel)
    finally:
        finished.set()
        watcher.join()
        refresh()
        bar.close()
    if failed:
        raise StudyError(
            "training failed for " + "; ".join(failed) + ". Fix: read the log named, correct the "
            "cause and run the same command again (finished runs are kept)"
        )
    return {(t.name, v, i): _run_dir(out, t, v, i) for t, v, i in jobs}


def _final_val_loss(run_dir: Path) -> float:
    rows = read_metrics(run_dir)
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    if not vals:
        raise StudyError(
            f"{run_dir}: no validation loss in metrics.jsonl. Fix: set train.eval_every_steps in its recipe"
        )
    return float(vals[-1])


def evaluate_all(runs: dict[tuple[str, str, int], Path], tasks, n: int) -> dict[tuple[str, str, int], dict]:
    """Each run's final checkpoint on its task (drawn with the seed the run trained with)."""
    results = {}
    for (task_name, variant, i), run_dir in progress_bar(
        runs.items(), total=len(runs), desc="evaluating", unit="model", dynamic_ncols=True
    ):
        task = next(t for t in tasks if t.name == task_name)
        if task.is_text:
            results[(task_name, variant, i)] = {"val_loss": _final_val_loss(run_dir)}
            continue
        device = "cuda" if torch.cuda.is_available() else "cpu"
        opts = EvalOptions(
            task_args=task.task_args, synthetic_n=n, progress=False, task_seed=_recipe_seed(task) + i, device=device
        )
        res = evaluate_checkpoint(run_dir, [f"synthetic:{task_name}"], opts)
        scores = res["tasks"][f"synthetic:{task_name}"]
        results[(task_name, variant, i)] = {k: scores[k] for k in ("acc", "samples", "loss")}
        results[(task_name, variant, i)]["step"] = res["checkpoint"].get("step")
    return results


def aggregate(per_seed: dict[tuple[str, str, int], float]) -> dict[tuple[str, str], Spread]:
    """{(task, variant, seed index): value} -> {(task, variant): Spread over the seeds}."""
    cells: dict[tuple[str, str], list[float]] = {}
    for (t, v, _), x in sorted(per_seed.items()):
        cells.setdefault((t, v), []).append(x)
    return {k: Spread.of(xs) for k, xs in cells.items()}


def verdict(acc: dict[tuple[str, str], float | Spread], variants: list[str]) -> str:
    """One line: does MixiT match standard on arithmetic and fail retrieval? (On the means over seeds.)"""
    if (
        not {"standard", "mixit"} <= set(variants)
        or (ARITHMETIC, "mixit") not in acc
        or (RETRIEVAL, "mixit") not in acc
    ):
        return "(the verdict needs standard and mixit on modular addition and kv retrieval)"
    add_std, add_mix = float(acc[(ARITHMETIC, "standard")]), float(acc[(ARITHMETIC, "mixit")])
    kv_std, kv_mix = float(acc[(RETRIEVAL, "standard")]), float(acc[(RETRIEVAL, "mixit")])
    matches = add_mix >= add_std - 0.10
    fails = kv_mix <= kv_std - 0.30 and kv_mix <= CONTEXT_GUESS + 0.10
    holds = "HOLDS" if matches and fails else "does NOT hold at this scale"
    return (
        f"Paper's qualitative result {holds}: MixiT {'matches' if matches else 'trails'} standard on arithmetic "
        f"({add_mix:.0%} vs {add_std:.0%}) and {'fails' if fails else 'does not fail'} retrieval "
        f"({kv_mix:.0%} vs {kv_std:.0%}; the in-context guess, the most frequent value in the context, gets "
        f"{CONTEXT_GUESS:.1%})."
    )


def _cell(task: DemoTask, value: float | Spread) -> str:
    """0.5 -> '50.0%'; a Spread over several seeds -> '50.0 ± 1.2%' (text: '1.448 ± 0.010')."""
    if isinstance(value, Spread) and len(value.values) > 1:
        if task.is_text:
            return f"{value.mean:.3f} ± {value.std:.3f}"
        return f"{100 * value.mean:.1f} ± {100 * value.std:.1f}%"
    value = float(value)
    return f"{value:.3f}" if task.is_text else f"{value:.1%}"


def table(acc: dict[tuple[str, str], float | Spread], tasks, variants: list[str]) -> str:
    """Tasks as rows (ours | paper per variant): reads well for 2 tasks and for 7."""
    header = ["task", *(h for v in variants for h in (v, "paper")), "chance"]
    rows = []
    for t in tasks:
        chance = "—" if t.is_text else f"{t.chance:.1%}"
        if t.name == RETRIEVAL:
            chance += f" (in-context guess {CONTEXT_GUESS:.1%}: the most frequent value in the context)"
        cells = [c for v in variants for c in (_cell(t, acc[(t.name, v)]), PAPER.get(t.name, {}).get(v, "—"))]
        rows.append([t.label, *cells, chance])
    return markdown_table(header, rows, right_from=1)


def plot(
    out: Path, runs: dict[tuple[str, str, int], Path], acc: dict[tuple[str, str], Spread], tasks, variants: list[str]
) -> Path:
    """Accuracy bars (mean over seeds, std as the error bar, each seed a dot) and training-loss curves
    (one line per seed)."""
    bars = [t for t in tasks if not t.is_text]
    n_cols = min(4, 1 + len(tasks))  # the paper suite's 8 panels in two rows of 4
    n_rows = -(-(1 + len(tasks)) // n_cols)
    fig, grid = new_figure(n_rows, n_cols, figsize=(4.5 * n_cols, 4.2 * n_rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[1 + len(tasks) :]:
        ax.axis("off")
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [j + i * width for j in range(len(bars))]
        cells = [acc[(t.name, v)] for t in bars]
        axes[0].bar(xs, [c.mean for c in cells], width, yerr=[c.std for c in cells], label=v, color=f"C{i}", capsize=2)
        for x, c in zip(xs, cells):
            if len(c.values) > 1:
                axes[0].plot([x] * len(c.values), c.values, "k.", markersize=3)
    for j, t in enumerate(bars):
        axes[0].hlines(t.chance, j - width / 2, j + width * (len(variants) - 0.5), colors="gray", linestyles=":")
        if t.name == RETRIEVAL:
            axes[0].hlines(
                CONTEXT_GUESS, j - width / 2, j + width * (len(variants) - 0.5), colors="gray", linestyles="--"
            )
    ticks = [j + width * (len(variants) - 1) / 2 for j in range(len(bars))]
    axes[0].set_xticks(ticks, [t.name for t in bars], rotation=30, ha="right", fontsize=8)
    axes[0].set_ylim(0, 1.05)
    axes[0].set_ylabel("test accuracy (scored positions)")
    axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(variants), fontsize=8)
    seeds = max(len(c.values) for c in acc.values())
    axes[0].set_title(
        "accuracy (dotted: chance; dashed: in-context guess)"
        + (f"; {seeds} seeds, bar = mean ± std" if seeds > 1 else "")
    )
    for ax, t in zip(axes[1:], tasks):
        for i, v in enumerate(variants):
            for (tn, vn, s), run_dir in runs.items():
                if (tn, vn) != (t.name, v):
                    continue
                rows = read_metrics(run_dir)
                pts = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
                if pts:
                    ax.plot(*zip(*pts), label=v if s == 0 else None, color=f"C{i}", alpha=0.8 if s == 0 else 0.4)
        ax.set_yscale("log")
        label_axes(ax, "step", "training loss", t.label, grid=False)
    return save_figure(fig, out / "demo.png", dpi=110)


def _positive(kind):
    def parse(text: str):
        v = kind(text)
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text} is not a positive number")
        return v

    parse.__name__ = kind.__name__
    return parse


def run(args: argparse.Namespace) -> int:
    suite = SUITES[args.suite]
    tasks = suite["tasks"]
    if args.tasks:
        wanted = names(args.tasks)
        known = {t.name: t for t in tasks}
        unknown = [t for t in wanted if t not in known]
        if unknown:
            raise StudyError(
                f"--tasks {','.join(unknown)}: not in the {args.suite} suite. Fix: choose from {sorted(known)}"
            )
        tasks = tuple(known[t] for t in wanted)
    variants = names(args.variants or suite["variants"])
    check_variants(variants)
    out = Path(args.out or f"outputs/{args.suite}")
    out.mkdir(parents=True, exist_ok=True)
    parallel = args.parallel or (1 if torch.cuda.is_available() else max(1, min(2, os.cpu_count() or 1)))
    device = "GPU" if torch.cuda.is_available() else "CPU"
    print(
        f"[{args.suite}] training {len(tasks) * len(variants) * args.seeds} tiny models on {device} "
        f"({parallel} at a time) into {out}"
    )
    start = time.time()
    runs = train_all(out, tasks, variants, args.steps_scale, parallel, args.seeds)
    results = evaluate_all(runs, tasks, args.eval_samples)
    acc = aggregate({k: r.get("acc", r.get("val_loss")) for k, r in results.items()})
    text = table(acc, tasks, variants)
    line = verdict(acc, variants)
    png = plot(out, runs, acc, tasks, variants)
    seconds = time.time() - start
    summary = {
        f"{t}/{v}": {"mean": c.mean, "std": c.std, "min": c.lo, "max": c.hi, "values": list(c.values)}
        for (t, v), c in acc.items()
    }
    per_run = {f"{t}/{v}" + (f"/s{i}" if i else ""): r for (t, v, i), r in results.items()}
    record = {"seeds": args.seeds, "seconds": round(seconds), "cells": summary, "runs": per_run}
    (out / "results.json").write_text(json.dumps(record, indent=2))
    seeds_note = f"{args.seeds} seeds per cell, mean ± std. " if args.seeds > 1 else ""
    (out / "results.md").write_text(text + "\n\n" + line + "\n\n" + seeds_note + f"{seconds:.0f} s wall.\n")
    print(f"\n{text}\n\n{line}")
    print(f"plot: {png}   table: {out / 'results.md'}   ({seconds:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.demo", __doc__)
    ap.add_argument("--suite", default="demo", choices=sorted(SUITES))
    ap.add_argument("--out", help="default: outputs/<suite>")
    ap.add_argument("--variants", help="default: the suite's")
    ap.add_argument("--tasks", help="comma-separated task names of the suite (default: all of them)")
    ap.add_argument("--steps-scale", type=_positive(float), default=1.0, help="multiply every recipe's max_steps")
    ap.add_argument("--parallel", type=_positive(int), help="runs at once (default: 2 on CPU, 1 on GPU)")
    ap.add_argument("--eval-samples", type=_positive(int), default=512)
    seeds = "train every cell with this many seeds (recipe seed + 0..N-1); cells show mean ± std"
    ap.add_argument("--seeds", type=_positive(int), default=1, help=seeds)
    args = ap.parse_args(argv)
    return run_cli(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
