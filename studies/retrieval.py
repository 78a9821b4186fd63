"""Key-value retrieval at the paper's size: does attention retrieve where MixiT cannot, and is it trained
Q/K or their initial scale that decides?

    python -m studies.retrieval --baselines --pairs 16                       # chance and context guesses, no training
    python -m studies.retrieval --stage sweep --pairs 16                     # every arm x the rate grid, seed 0
    python -m studies.retrieval --stage seeds --pairs 16                     # 5 seeds per arm at its best rate
    python -m studies.retrieval --stage seeds --pairs 30 --lr-pairs 16       # at the rates chosen at 16 pairs
    python -m studies.retrieval --stage all                                  # the page's plan, in order
    python -m studies.retrieval --render                                     # the page's table from the rows

Trains recipes/retrieval_kv.yaml (keys from 32 symbols, values from --values, 1 to --pairs pairs per
example) one run at a time in this process, with a hook (pretrain/hooks.py) scoring held-out accuracy
on the answer token (eval/synthetic_tasks.py) every `train.eval_every_steps`, then the final
checkpoint on --eval-samples held-out examples (eval/run.py). An arm is a variant, or VARIANT@STD: its
Q/K initialised at that std instead of the recipe's (standard@0.02, frozen_qk@0.02: the controls that
separate freezing from the initial scale). Each finished run appends its row (`train_cell`) to --rows
(JSONL); a cell whose row exists is skipped, so a later session resumes from the committed rows; run
dirs under --out are scratch. The sweep picks each arm's rate by final accuracy (then held-out loss);
when the best rate sits at an edge of the grid the grid grows by a factor of 3 that way (at most
--extend times). The seeds stage trains seeds 0..N-1 at that rate (seed 0 is the sweep's run), or at
the rate chosen at --lr-pairs and --lr-values. Training stops once the rows' CPU seconds reach
--budget-cpu-h. Seed i trains with the recipe's seed + i (init, data order, the task's held-out draw)
and MixiT matrices of seed i.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.cli import floats, ints, run_cli
from common.constants import DEFAULT_SEED
from common.errors import NonFiniteLoss, StudyError
from data_pipeline.synthetic import get_task
from eval.report import markdown_table
from eval.run import EvalOptions, evaluate_checkpoint
from eval.synthetic_tasks import evaluate_task
from pretrain.config import load_recipe
from pretrain.metrics import read_metrics
from pretrain.train import train

from .rows import read_rows
from .shared import (
    arm_order,
    arm_overrides,
    check_variants,
    chosen_rate,
    names,
    ran_to_end,
    rate_choices,
    rates_to_sweep,
    seed_overrides,
    split_arm,
    study_parser,
    train_missing,
)
from .spread import Spread, wilson

RECIPE = "recipes/retrieval_kv.yaml"
ROWS = "docs/data/retrieval/runs.jsonl"
PAGE = "docs/results/retrieval.md"
TASK = "kv_retrieval"
GRID = (3.33e-4, 1e-3, 3e-3, 1e-2, 3e-2)  # every arm the same grid (docs/results/retrieval.md, "Amended")
SOLVED = 0.9  # held-out accuracy that counts as having left the plateau
# --stage all, in order (docs/results/retrieval.md, "Plan"): the sweep and 5 seeds at 16 pairs and 32 values; then
# 30 pairs, then 255 values at 16 and 30 pairs, each at the rates chosen at 16 pairs and 32 values.
ARMS = ["standard", "frozen_qk", "mixit", "standard@0.02", "frozen_qk@0.02"]
PLAN = (
    ("sweep", {"pairs": [16], "values": 32}),
    ("seeds", {"pairs": [16], "values": 32}),
    ("seeds", {"pairs": [30], "values": 32, "lr_pairs": 16}),
    ("seeds", {"pairs": [16], "values": 255, "lr_pairs": 16, "lr_values": 32}),
    ("seeds", {"pairs": [30], "values": 255, "lr_pairs": 16, "lr_values": 32}),
)
# --stage budget, in order (docs/results/retrieval.md, "Budget and training"): MixiT's seeded sweep at the paper's
# setting (30 pairs, 255 values) and its 5 seeds there; the other arms' 5 seeds there at their rates chosen at 16
# pairs and 32 values; then 4x the steps at 30 pairs and 32 values, the main arms first, MixiT at its seeded rate.
STEPS_1X = 1562
PAPER = {"pairs": [30], "values": 255}
QK_ARMS, CONTROLS = ["standard", "frozen_qk"], ["standard@0.02", "frozen_qk@0.02"]
AT_16 = {"lr_pairs": 16, "lr_values": 32, "lr_steps": STEPS_1X}
AT_PAPER = {"lr_pairs": 30, "lr_values": 255, "lr_steps": STEPS_1X}
LONG = {"pairs": [30], "values": 32, "steps": 4 * STEPS_1X}
BUDGET_PLAN = (
    ("sweep", {**PAPER, "variants": ["mixit"], "sweep_seeds": 2}),
    ("seeds", {**PAPER, "variants": ["mixit"], **AT_PAPER}),
    ("seeds", {**PAPER, "variants": QK_ARMS + CONTROLS, **AT_16}),
    ("seeds", {**LONG, "variants": QK_ARMS, **AT_16}),
    ("seeds", {**LONG, "variants": ["mixit"], **AT_PAPER}),
    ("seeds", {**LONG, "variants": CONTROLS, **AT_16}),
)
UNTRAINED_NATS = (
    0.05  # "did not train": a final loss within this of ln V, the loss of knowing only the answer is a value
)
TABLE_BEGIN, TABLE_END = "<!-- table:retrieval -->", "<!-- /table:retrieval -->"  # as studies.results_page


@dataclass(frozen=True)
class Cell:
    """One training run: what identifies its row."""

    n_pairs: int
    arm: str  # a variant, or VARIANT@STD: its Q/K initialised at that std (studies/shared.py)
    lr: float
    seed: int  # seed index: the recipe's seed + seed
    steps: int
    n_keys: int
    n_values: int

    @property
    def name(self) -> str:
        return f"p{self.n_pairs}-{self.arm}-lr{self.lr:g}-s{self.seed}-n{self.steps}-v{self.n_values}"

    def key(self) -> tuple:
        return (self.n_pairs, self.arm, float(self.lr), self.seed, self.steps, self.n_keys, self.n_values)


def arm_of(row: dict) -> str:
    return row.get("arm", row["variant"])


def row_key(row: dict) -> tuple:
    a = row["task_args"]
    return (a["n_pairs"], arm_of(row), float(row["lr"]), row["seed"], row["steps"], a["n_keys"], a["n_values"])


# -- baselines --------------------------------------------------------------------------------------
def slot_guess_exact(n_pairs: int, n_values: int, min_pairs: int = 1) -> float:
    """Accuracy of naming the value of a uniformly chosen pair in the context, exactly: with n pairs
    the guess hits the query's own pair (1/n) or another pair holding the same value ((n-1)/n * 1/V)."""
    ns = range(min_pairs, n_pairs + 1)
    return sum((1 + (n - 1) / n_values) / n for n in ns) / len(ns)


def bag_loss_exact(n_pairs: int, n_values: int, min_pairs: int = 1) -> float:
    """Held-out loss (nats) of predicting the context's value frequencies, exactly: the answer's value
    occurs 1 + Binomial(n - 1, 1/V) times among n, and the loss is -log(count / n). A model on the
    plateau that uses the bag of context values but not their keys sits here."""
    ns = range(min_pairs, n_pairs + 1)
    p = 1 / n_values
    return sum(
        sum(math.comb(n - 1, k) * p**k * (1 - p) ** (n - 1 - k) * -math.log((k + 1) / n) for k in range(n)) for n in ns
    ) / len(ns)


def mode_guess_exact(n_pairs: int, n_values: int, min_pairs: int = 1) -> float:
    """Accuracy of naming the most frequent value in the context, exactly: with n values drawn
    uniformly from V the query's value is a given value with probability count / n, so the guess is
    right with probability E[max count] / n. P(max count <= k) = n! [x^n] (sum_{j<=k} x^j / j!)^V / V^n."""
    top = n_pairs
    factorial = [math.factorial(j) for j in range(top + 1)]
    below = []  # below[k][n] = P(max count <= k) for n values
    for k in range(top + 1):
        base = np.array([1 / factorial[j] if j <= k else 0.0 for j in range(top + 1)])
        power = np.zeros(top + 1)
        power[0] = 1.0
        for _ in range(n_values):
            power = np.convolve(power, base)[: top + 1]
        below.append([power[n] * factorial[n] / n_values**n for n in range(top + 1)])
    ns = range(min_pairs, n_pairs + 1)
    return sum(sum(1 - below[m - 1][n] for m in range(1, n + 1)) / n for n in ns) / len(ns)


def context_guesses(task, samples: int) -> dict[str, float]:
    """Monte Carlo over the task's own generator (its held-out split): the accuracy of the slot guess
    (expected, per example) and of the best guess from the bag of context values without the keys
    (the most frequent value: right with probability max count / n), and the loss of predicting the
    context's value frequencies."""
    value_ids = {task.ids[f"v{i}"] for i in range(task.n_values)}
    slot = mode = bag = 0.0
    for i in range(samples):
        toks, _ = task.sample(i, "test")
        context = toks[: toks.index(task.ids["?"])]
        vals = [t for t in context if t in value_ids]
        answer = toks[-2]
        counts = np.bincount(vals)
        slot += counts[answer] / len(vals)
        mode += counts.max() / len(vals)
        bag -= math.log(counts[answer] / len(vals))
    return {"slot_guess_mc": slot / samples, "mode_guess_mc": mode / samples, "bag_loss_mc": bag / samples}


def baselines(
    n_pairs: int, n_keys: int, n_values: int, samples: int = 20000, seed: int = DEFAULT_SEED
) -> dict[str, float]:
    task = get_task(TASK, seed=seed, n_pairs=n_pairs, min_pairs=1, n_keys=n_keys, n_values=n_values)
    return {
        "chance": 1 / n_values,
        "slot_guess_exact": slot_guess_exact(n_pairs, n_values),
        "mode_guess_exact": mode_guess_exact(n_pairs, n_values),
        "bag_loss_exact": bag_loss_exact(n_pairs, n_values),
        **context_guesses(task, samples),
        "samples": samples,
    }


# -- rows -------------------------------------------------------------------------------------------
def first_step(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first probed step whose accuracy reaches `threshold` (None: never)."""
    return next((s for s, a in curve if a >= threshold), None)


def retrieval_score(r: dict) -> tuple:
    """How a sweep ranks its runs: final accuracy, then held-out loss; a diverged run last."""
    return (-1.0, 0.0) if r["acc"] is None else (r["acc"], -r["loss"])


def did_not_train(r: dict) -> bool:
    """A run whose held-out loss ended within UNTRAINED_NATS of ln V: it learned at most that the answer is
    one of V values (every run starts above that, at ln of the vocabulary), nothing from the context. It
    counts for no verdict (docs/results/retrieval.md, "Did not train"); a diverged run did not train either."""
    return r["acc"] is None or r["loss"] >= math.log(r["task_args"]["n_values"]) - UNTRAINED_NATS


def group_score(g: dict) -> tuple:
    """How a sweep of several seeds per rate ranks its rates: how many seeds trained, then their mean held-out
    accuracy, then their mean loss (diverged seeds at 0 and infinity)."""
    rs = g["runs"]
    acc = sum(r["acc"] or 0.0 for r in rs) / len(rs)
    loss = sum(math.inf if r["acc"] is None else r["loss"] for r in rs) / len(rs)
    return (sum(not did_not_train(r) for r in rs), acc, -loss)


def sweep_rows(
    rows: list[dict], n_pairs: int, arm: str, steps: int, n_values: int | None = None, seeds: int = 1
) -> list[dict]:
    """The sweep's rows (seeds 0..seeds-1) of (n_pairs, arm, steps[, n_values])."""
    return [
        r
        for r in rows
        if r["task_args"]["n_pairs"] == n_pairs and arm_of(r) == arm and r["seed"] < seeds and r["steps"] == steps
        and (n_values is None or r["task_args"]["n_values"] == n_values)
    ]  # fmt: skip


def sweep_seeds_of(rows: list[dict], n_pairs: int, arm: str, steps: int, n_values: int) -> int:
    """How many seeds per rate the sweep at this setting trained (1: the one-seed sweeps)."""
    seeds = [
        r["seed"] for r in sweep_rows(rows, n_pairs, arm, steps, n_values, seeds=10**9) if r.get("stage") == "sweep"
    ]
    return 1 + max(seeds, default=0)


# -- training -----------------------------------------------------------------------------------------
class AccuracyProbe:
    """Training hook: held-out scores on the answer (`keys` of the evaluation code's), as probe/KEY."""

    def __init__(self, task, samples: int, keys: tuple[str, ...] = ("acc", "loss")):
        self.task, self.samples, self.keys = task, samples, keys

    def __call__(self, model: torch.nn.Module, step: int) -> dict:
        res = evaluate_task(model, self.task, n=self.samples, split="test", progress=False)
        return {f"probe/{k}": res[k] for k in self.keys}


def command_for(cell: Cell, recipe: str) -> str:
    """The command that trains exactly this cell (and skips it once its row exists)."""
    command = f"python -m studies.retrieval --stage seeds --pairs {cell.n_pairs} --variants {cell.arm} --lr {cell.lr:g}"
    command += f" --seed-list {cell.seed} --steps {cell.steps} --keys {cell.n_keys} --values {cell.n_values}"
    return command + (f" --recipe {shlex.quote(recipe)}" if recipe != RECIPE else "")


def train_scored(recipe: str, overrides: list[str], run_dir: Path, task, args, keys=("acc", "loss"), may_diverge=False):
    """Train one run (resuming a partial run dir) with an `AccuracyProbe` of `keys`, score its final checkpoint
    on --eval-samples held-out examples of `task`, and return what every study row of it holds: the scores,
    the probe curve of keys[0], the time spent. With `may_diverge`, a non-finite loss is recorded as
    `diverged` (a rate too high for the variant: a row that no sweep picks) with no scores."""
    wall0, cpu0 = time.time(), time.process_time()
    diverged = None
    try:
        res = train(
            recipe, overrides, run_dir=run_dir, resume="auto", hooks=[AccuracyProbe(task, args.probe_samples, keys)]
        )
    except NonFiniteLoss as e:
        if not may_diverge:
            raise
        diverged = str(e)
    else:
        ran_to_end(res, run_dir.name)
    scores = {k: None for k in keys} | {"samples": 0}
    if diverged is None:
        opts = EvalOptions(task_args=task.args, synthetic_n=args.eval_samples, task_seed=task.seed, progress=False)
        scores = evaluate_checkpoint(run_dir, [f"synthetic:{task.name}"], opts)["tasks"][f"synthetic:{task.name}"]
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []  # none: diverged at step 1
    return {
        **({"diverged": diverged} if may_diverge else {}),
        **{k: scores[k] for k in keys},
        "eval_samples": scores["samples"],
        "curve": [(r["step"], r[f"probe/{keys[0]}"]) for r in records if f"probe/{keys[0]}" in r],
        "wall_s": round(time.time() - wall0, 1),
        "cpu_s": round(time.process_time() - cpu0, 1),
        "torch_threads": torch.get_num_threads(),
    }


def train_cell(cell: Cell, args: argparse.Namespace) -> dict:
    """Train one cell (resuming a partial run dir), evaluate it, and return its row."""
    recipe_seed = load_recipe(args.recipe).seed
    targs = {"n_pairs": cell.n_pairs, "min_pairs": 1, "n_keys": cell.n_keys, "n_values": cell.n_values}
    overrides = [
        *arm_overrides(cell.arm),
        *seed_overrides(recipe_seed, cell.seed),
        f"optim.lr={cell.lr}",
        f"train.max_steps={cell.steps}",
        f"train.seq_len={2 * cell.n_pairs + 4}",
        f"train.eval_every_steps={args.probe_every}",
        f"checkpoint.every_steps={max(args.probe_every, cell.steps // 4)}",
        "data.task_args=" + json.dumps(targs),
        *args.override,
    ]
    task = get_task(TASK, seed=recipe_seed + cell.seed, **targs)
    run = train_scored(args.recipe, overrides, Path(args.out) / "runs" / cell.name, task, args, may_diverge=True)
    final = run["acc"] if run["acc"] is not None else float("inf")
    return {
        "command": command_for(cell, args.recipe),
        "recipe": args.recipe,
        "overrides": overrides,
        "task": TASK,
        "task_args": targs,
        "variant": split_arm(cell.arm)[0],
        "arm": cell.arm,
        "seed": cell.seed,
        "lr": cell.lr,
        "steps": cell.steps,
        **run,
        "step_90pct_of_final": first_step(run["curve"], 0.9 * final),
        "step_solved": first_step(run["curve"], SOLVED),
        "stage": args.stage,
    }


def cells_for(args: argparse.Namespace, rows: list[dict], pairs: int, variant: str) -> list[Cell]:
    """The cells this stage still needs for (pairs, variant), given the rows so far."""
    base = dict(n_pairs=pairs, arm=variant, steps=args.steps, n_keys=args.keys, n_values=args.values)
    if args.stage == "sweep":
        k = args.sweep_seeds
        swept = sweep_rows(rows, pairs, variant, args.steps, args.values, k)
        ranked, by, partial = rate_choices(swept, k, retrieval_score, group_score)
        rates = rates_to_sweep(sorted({*args.grid, *partial}), ranked, by, args.extend)
        return [Cell(lr=lr, seed=s, **base) for lr in rates for s in range(k)]
    if args.lr is not None:
        lr = args.lr
    else:
        lr_pairs, lr_values = args.lr_pairs or pairs, args.lr_values or args.values
        lr_steps = args.lr_steps or args.steps
        k = sweep_seeds_of(rows, lr_pairs, variant, lr_steps, lr_values)
        ranked, by, partial = rate_choices(
            sweep_rows(rows, lr_pairs, variant, lr_steps, lr_values, k), k, retrieval_score, group_score
        )
        lr = chosen_rate(
            [] if partial else ranked,
            by,
            args.grid,
            args.extend,
            f"{variant} at {lr_pairs} pairs, {lr_values} values and {lr_steps} steps",
            f"run --stage sweep --pairs {lr_pairs} --values {lr_values} --steps {lr_steps}"
            + (f" --sweep-seeds {k}" if k > 1 else "")
            + ", or give --lr",
        )
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    return [Cell(lr=lr, seed=s, **base) for s in seeds]


def run_stage(args: argparse.Namespace, log=print) -> int | None:
    """Train every missing cell of the stage, one at a time; returns how many were trained (None: the
    CPU budget is spent)."""

    def todo_of(rows: list[dict]) -> list[Cell]:
        done = {row_key(r) for r in rows}
        todo = [c for p in args.pairs for v in args.variants for c in cells_for(args, rows, p, v)]
        # seed-major within a pair count: a stage the budget cuts short leaves every arm with the same seeds
        return sorted(
            (c for c in todo if c.key() not in done),
            key=lambda c: (c.n_pairs, c.seed, args.variants.index(c.arm), c.lr),
        )

    def result(row: dict) -> str:
        return "acc diverged" if row["acc"] is None else f"acc {row['acc']:.3f}"

    return train_missing(
        args.stage, Path(args.rows), args.budget_cpu_h, todo_of, lambda c: train_cell(c, args), result, log
    )


# -- the table --------------------------------------------------------------------------------------
def render(rows: list[dict]) -> str:
    """Markdown: per (pairs, steps, variant) the rows at the rate with the most seeds (then the best
    mean), mean ± std over seeds, how many solved, the baselines under each pair count; then the sweep."""
    if not rows:
        return "(no runs yet)"
    lines = [
        "| pairs (keys, values) | variant | rate | steps | seeds | trained (loss below ln V - 0.05) | "
        "held-out accuracy (mean ± std) | per seed (%) | solved (≥ 90 %), 95 % interval | median step solved |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["acc"] is None:  # diverged: in the sweep's table only
            continue
        a = r["task_args"]
        groups.setdefault((a["n_pairs"], a["n_keys"], a["n_values"], r["steps"], arm_of(r), r["lr"]), []).append(r)
    chosen: dict[tuple, dict[str, list[dict]]] = {}
    for (*setting, variant, lr), rs in sorted(groups.items()):
        score = (len(rs), Spread.of(r["acc"] for r in rs).mean)
        cur = chosen.setdefault(tuple(setting), {}).get(variant)
        if cur is None or score > (len(cur), Spread.of(r["acc"] for r in cur).mean):
            chosen[tuple(setting)][variant] = rs
    for (p, k, v, steps), per_variant in sorted(chosen.items()):
        for variant in sorted(per_variant, key=arm_order):
            rs = sorted(per_variant[variant], key=lambda r: r["seed"])
            acc = Spread.of(r["acc"] for r in rs)
            solved = sorted(r["step_solved"] for r in rs if r["step_solved"] is not None)
            median = f"{solved[len(solved) // 2]}" if solved else "—"
            per_seed = ", ".join(f"{100 * r['acc']:.1f}" for r in rs)
            lo, hi = wilson(len(solved), len(rs))
            trained = sum(not did_not_train(r) for r in rs)
            lines.append(
                f"| {p} ({k}, {v}) | {variant} | {rs[0]['lr']:g} | {steps} | {len(rs)} | {trained}/{len(rs)} | {100 * acc.mean:.1f} ± "
                f"{100 * acc.std:.1f} % | {per_seed} | {len(solved)}/{len(rs)} ({100 * lo:.0f}-{100 * hi:.0f} %) | {median} |"
            )
        lines.append(f"| {p} ({k}, {v}) | *chance (1/{v})* | | | | | {100 / v:.1f} % | | | |")
        guess = "*in-context guess (most frequent context value, exact)*"
        lines.append(f"| {p} ({k}, {v}) | {guess} | | | | | {100 * mode_guess_exact(p, v):.1f} % | | | |")
    sweep = sorted(
        (r for r in rows if r["seed"] == 0 and r.get("stage") != "curve"),
        key=lambda r: (
            r["task_args"]["n_pairs"],
            r["task_args"]["n_values"],
            r["steps"],
            arm_order(arm_of(r)),
            r["lr"],
        ),
    )
    if sweep:
        lines += ["", "Rate sweep (seed 0; final held-out accuracy and loss):", ""]
        table = []
        for r in sweep:
            solved = r["step_solved"] if r["step_solved"] is not None else "—"
            acc, loss = ("diverged", "—") if r["acc"] is None else (f"{100 * r['acc']:.1f} %", f"{r['loss']:.3f}")
            a = r["task_args"]
            table.append([a["n_pairs"], a["n_values"], arm_of(r), r["steps"], f"{r['lr']:g}", acc, loss, solved])
        header = ["pairs", "values", "variant", "steps", "rate", "accuracy", "loss", "step solved"]
        lines.append(markdown_table(header, table, align="rrlrrrrr"))
    lines += time_to_solve(rows)
    spent = sum(r["cpu_s"] for r in rows)
    lines += [
        "",
        f"{len(rows)} runs, {spent / 3600:.2f} CPU-hours of training (`python -m studies.retrieval --render`).",
    ]
    return "\n".join(lines)


def time_to_solve(rows: list[dict], variant: str = "standard") -> list[str]:
    """Markdown lines: `variant`'s step solved against the number of pairs (every seed, at the rate with
    the most seeds), and where at least two pair counts were solved in every seed, the power law
    step = a * pairs^b fitted to their medians (least squares in log-log) and its extrapolation to the
    pair counts not solved: the budget a setting needs, not a measurement of it."""
    by_pairs: dict[int, list[dict]] = {}
    for r in rows:
        if arm_of(r) == variant and r["acc"] is not None:
            by_pairs.setdefault(r["task_args"]["n_pairs"], []).append(r)
    if len(by_pairs) < 2:
        return []
    lines = [
        "",
        f"Time to solve against pairs ({variant}; the step each seed first reached {SOLVED:.0%} held-out accuracy):",
        "",
    ]
    table, medians = [], {}
    for p, rs in sorted(by_pairs.items()):
        lr = max({r["lr"] for r in rs}, key=lambda x: sum(r["lr"] == x for r in rs))
        rs = sorted((r for r in rs if r["lr"] == lr), key=lambda r: r["seed"])
        steps = [r["step_solved"] for r in rs]
        solved = sorted(x for x in steps if x is not None)
        median = solved[len(solved) // 2] if len(solved) == len(rs) else None
        if median is not None:
            medians[p] = median
        cells = ", ".join("—" if x is None else str(x) for x in steps)
        table.append([p, rs[0]["steps"], len(rs), f"{len(solved)}/{len(rs)}", cells, median if median else "—"])
    header = ["pairs", "steps trained", "seeds", "solved", "step solved, per seed", "median"]
    lines.append(markdown_table(header, table, align="rrrrlr"))
    if len(medians) >= 2:
        x, y = np.log(list(medians)), np.log(list(medians.values()))
        b, log_a = np.polyfit(x, y, 1)
        guesses = []
        for p in (p for p in sorted(by_pairs) if p not in medians):
            predicted, trained = math.exp(log_a) * p**b, max(r["steps"] for r in by_pairs[p])
            verdict = "below the steps trained there, so the fit understates the growth" if predicted < trained else ""
            guesses.append(f"{p} pairs ~{predicted:,.0f} steps" + (f" ({verdict})" if verdict else ""))
        lines += [
            "",
            f"Fit to the medians of {', '.join(str(p) for p in medians)} pairs: step ≈ {math.exp(log_a):.0f} · pairs^{b:.2f}"
            + (f"; extrapolated: {'; '.join(guesses)}." if guesses else "."),
        ]
    return lines


def baselines_table(settings: list[tuple[int, int, int]]) -> str:
    """Markdown: chance and the exact context guesses (and the bag loss) per (pairs, keys, values); tests
    check the exact formulas against the task's own generator by Monte Carlo and by full enumeration."""
    header = [
        "pairs (keys, values)",
        "chance",
        "slot guess, exact",
        "mode guess (in-context guess G), exact",
        "bag loss, nats",
    ]
    rows = [
        [
            f"{p} ({n_keys}, {n_values})",
            f"{100 / n_values:.1f} %",
            f"{100 * slot_guess_exact(p, n_values):.1f} %",
            f"{100 * mode_guess_exact(p, n_values):.1f} %",
            f"{bag_loss_exact(p, n_values):.2f}",
        ]
        for p, n_keys, n_values in settings
    ]
    return markdown_table(header, rows, right_from=0)


def render_page(page: Path, rows: list[dict]) -> bool:
    """Replace the table between the page's markers; True if the page changed."""
    text = page.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise StudyError(f"{page} has no table markers. Fix: add the lines {TABLE_BEGIN} and {TABLE_END}")
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    new = head + TABLE_BEGIN + "\n" + render(rows) + "\n" + TABLE_END + tail
    page.write_text(new)
    return new != text


# -- CLI ------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    check_variants(args.variants)
    if any(p < 1 or 2 * p + 4 > 64 for p in args.pairs):
        raise StudyError(f"--pairs {args.pairs}: need 1 <= pairs <= 30 (the recipe's 64-token context). Fix: lower it")
    if args.baselines:
        for p in args.pairs:
            b = baselines(p, args.keys, args.values, args.baseline_samples)
            print(json.dumps({"n_pairs": p, "n_keys": args.keys, "n_values": args.values, **b}))
        return 0
    if args.render:
        changed = render_page(Path(args.page), read_rows(Path(args.rows)))
        print(f"{args.page}: {'updated' if changed else 'unchanged'}")
        return 0
    torch.set_num_threads(args.threads)
    plans = {"all": PLAN, "budget": BUDGET_PLAN}
    if args.stage not in plans:
        run_stage(args)
    for stage, changes in plans.get(args.stage, ()):
        if run_stage(argparse.Namespace(**{**vars(args), "stage": stage, **changes})) is None:
            break
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"this process: {usage.ru_utime + usage.ru_stime:.0f} s CPU")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = study_parser("studies.retrieval", __doc__)
    ap.add_argument(
        "--stage",
        choices=("sweep", "seeds", "curve", "all", "budget"),
        default="sweep",
        help="all: the PLAN, in order; budget: the BUDGET_PLAN",
    )
    ap.add_argument("--pairs", type=ints, default=[16], help="comma-separated pair counts (default 16)")
    ap.add_argument(
        "--variants", type=names, default=ARMS, help="arms: VARIANT or VARIANT@STD (its Q/K initialised at STD)"
    )
    ap.add_argument("--keys", type=int, default=32)
    ap.add_argument("--values", type=int, default=32)
    ap.add_argument("--steps", type=int, default=STEPS_1X)
    ap.add_argument("--sweep-seeds", type=int, default=1, help="sweep: seeds 0..K-1 at every rate")
    ap.add_argument("--lr-steps", type=int, help="seeds/curve: the best rate of the sweep at this many steps")
    ap.add_argument("--grid", type=floats, default=list(GRID), help="the sweep's rates")
    ap.add_argument("--extend", type=int, default=2, help="rates the sweep may add beyond an edge")
    ap.add_argument("--lr", type=float, help="seeds/curve: this rate instead of the sweep's best")
    ap.add_argument("--lr-pairs", type=int, help="seeds/curve: the best rate of the sweep at this many pairs")
    ap.add_argument("--lr-values", type=int, help="seeds/curve: the best rate of the sweep at this many values")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed-list", type=ints, help="these seed indices instead of 0..--seeds-1")
    ap.add_argument("--probe-every", type=int, default=100)
    ap.add_argument("--probe-samples", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=2048)
    ap.add_argument(
        "--budget-cpu-h", type=float, default=10.0, help="stop training once the rows hold this many CPU-hours"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--page", default=PAGE)
    ap.add_argument("--out", default="outputs/retrieval", help="scratch run dirs")
    ap.add_argument("--override", action="append", default=[], help="extra recipe override (tests)")
    ap.add_argument("--baselines", action="store_true", help="print the baselines and exit")
    ap.add_argument("--baseline-samples", type=int, default=20000)
    ap.add_argument("--render", action="store_true", help="render the page's table from the rows and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
