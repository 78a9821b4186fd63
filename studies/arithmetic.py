"""Multi-digit addition, the paper's other half: does MixiT match standard where nothing is retrieved?

    python -m studies.arithmetic --stage sweep --digits 3                 # every arm x layout x the rate grid, seed 0
    python -m studies.arithmetic --stage seeds --digits 2,3,5 --lr-digits 3   # 5 seeds at the rates chosen at 3 digits
    python -m studies.arithmetic --stage all                              # the page's plan, in order
    python -m studies.arithmetic --stage ladder                           # the budget ladder (1x, 4x, 16x steps)
    python -m studies.arithmetic --render                                 # the table from the rows, nothing trained

Trains recipes/reference_addition.yaml (the reference implementation's model and optimiser) on reversed
decimal addition in both layouts (`--layouts`): `padded` (operands with leading zeros, the whole sum and
<eos> scored) and `reference` (the reference's additionstream_N: exact N-digit operands, answer tokens
of their own, the first sum digit neither trained nor scored). An arm is a variant, or VARIANT@STD: its
Q/K initialised at that std (the controls standard@0.02, frozen_qk@0.02). One run at a time in this
process, with a hook (pretrain/hooks.py) scoring held-out exact match (every scored token right) every
--probe-every steps; the final checkpoint is scored on --eval-samples held-out sums (eval/run.py): exact
match, and token accuracy over the scored positions (the reference's measure). The sweep trains seed 0
at every rate of --grid per (digits, layout, arm) and picks by exact match, then token accuracy, then
loss; with --sweep-seeds K > 1 it trains seeds 0..K-1 at every rate and picks by how many of them
solved the task, then by their mean held-out loss. A best rate at an edge grows the grid by x3 (at most
--extend times) and a seeds stage refuses it. A seeds stage takes the rate its sweep chose at --steps,
or at --lr-steps (the budget ladder: MixiT's rate chosen at 4x the steps serves every rung). Each finished run appends its row to --rows (`step_solved`: the first probed step at >= 90 % exact
match, None: not within the budget); a run whose row exists is skipped, so the command resumes from the
committed rows; run dirs under --out are scratch. Training stops once the rows hold --budget-cpu-h.
Seed i trains with the recipe's seed + i (init, data order, the held-out draw) and MixiT matrices of seed i.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from common.cli import floats, ints, run_cli
from common.errors import StudyError
from data_pipeline.synthetic import get_task
from eval.report import markdown_table
from pretrain.config import load_recipe

from .retrieval import first_step, train_scored
from .rows import read_rows
from .shared import (
    arm_order,
    arm_overrides,
    check_variants,
    chosen_rate,
    names,
    rate_choices,
    rates_to_sweep,
    seed_overrides,
    split_arm,
    study_parser,
    train_missing,
)
from .spread import Spread, wilson

RECIPE = "recipes/reference_addition.yaml"
ROWS = "docs/data/arithmetic/runs.jsonl"
TASK = "addition"
SOLVED = 0.9  # held-out exact match that counts as solved
ARMS = ["standard", "frozen_qk", "mixit", "standard@0.02", "frozen_qk@0.02"]
GRID = (3.33e-4, 1e-3, 3e-3, 1e-2, 3e-2)  # every arm the same grid, as retrieval
LAYOUTS = ("padded", "reference")
# --stage all, in order (docs/results/arithmetic.md, "Plan"): the sweep and 5 seeds at 3 digits, then 5 and 2
# digits at the rates chosen at 3.
PLAN = (
    ("sweep", {"digits": [3]}),
    ("seeds", {"digits": [3]}),
    ("seeds", {"digits": [5], "lr_digits": 3}),
    ("seeds", {"digits": [2], "lr_digits": 3}),
)
# --stage ladder, in order (docs/results/arithmetic.md, "The budget ladder"): 3 digits, reference layout,
# MixiT's rate re-chosen at 4x the steps with 3 seeds per rate; then 5 seeds of MixiT (at that rate) and
# standard (at its rate chosen at 1x) at 4x, MixiT at 1x, and both at 16x, the costliest rung last.
STEPS_1X = 1250
LADDER_COMMON = {"digits": [3], "layouts": ["reference"]}
LADDER = (
    ("sweep", {"variants": ["mixit"], "steps": 4 * STEPS_1X, "sweep_seeds": 3}),
    ("seeds", {"variants": ["mixit"], "steps": 4 * STEPS_1X, "lr_steps": 4 * STEPS_1X}),
    ("seeds", {"variants": ["standard"], "steps": 4 * STEPS_1X, "lr_steps": STEPS_1X}),
    ("seeds", {"variants": ["mixit"], "steps": STEPS_1X, "lr_steps": 4 * STEPS_1X}),
    ("seeds", {"variants": ["mixit"], "steps": 16 * STEPS_1X, "lr_steps": 4 * STEPS_1X}),
    ("seeds", {"variants": ["standard"], "steps": 16 * STEPS_1X, "lr_steps": STEPS_1X}),
)
LADDER_ARMS = ("standard", "mixit")
# The CPU-hours the arithmetic rows may hold before the ladder starts no new run (the page's cap, stated before
# the 16x rung): once it is spent, a rung's verdict is stated on the seeds it left, at least 3 an arm.
LADDER_CPU_H = 12.9


@dataclass(frozen=True)
class Cell:
    """One training run: what identifies its row."""

    digits: int
    layout: str
    arm: str
    lr: float
    seed: int
    steps: int

    @property
    def name(self) -> str:
        return f"d{self.digits}-{self.layout}-{self.arm}-lr{self.lr:g}-s{self.seed}-n{self.steps}"

    def key(self) -> tuple:
        return (self.digits, self.layout, self.arm, float(self.lr), self.seed, self.steps)


def row_key(r: dict) -> tuple:
    a = r["task_args"]
    return (a["n_digits"], a.get("layout", "padded"), r.get("arm", r["variant"]), float(r["lr"]), r["seed"], r["steps"])


def score(r: dict) -> tuple:
    """How a one-seed sweep ranks its runs: exact match, then token accuracy, then held-out loss; a diverged
    run last."""
    return (-1.0, -1.0, 0.0) if r["acc"] is None else (r["exact_match"], r["acc"], -r["loss"])


def solved(r: dict) -> bool:
    return r["acc"] is not None and r["step_solved"] is not None


def group_score(g: dict) -> tuple:
    """How a sweep of several seeds per rate ranks its rates: how many seeds solved, then the seeds' mean
    held-out loss (a diverged seed counts as unsolved at infinite loss)."""
    rs = g["runs"]
    mean_loss = sum(math.inf if r["acc"] is None else r["loss"] for r in rs) / len(rs)
    return (sum(map(solved, rs)), -mean_loss)


def sweep_rows(rows: list[dict], digits: int, layout: str, arm: str, steps: int, seeds: int = 1) -> list[dict]:
    """The sweep's rows of (digits, layout, arm, steps): seeds 0..seeds-1 at every rate."""
    return [r for r in rows if row_key(r)[:3] == (digits, layout, arm) and r["seed"] < seeds and r["steps"] == steps]


def sweep_seeds_of(rows: list[dict], digits: int, layout: str, arm: str, steps: int) -> int:
    """How many seeds per rate the sweep at this setting trained (1: the one-seed sweeps)."""
    seeds = [r["seed"] for r in rows if r.get("stage") == "sweep" and row_key(r)[:3] == (digits, layout, arm)
             and r["steps"] == steps]  # fmt: skip
    return 1 + max(seeds, default=0)


def cells_for(args: argparse.Namespace, rows: list[dict], digits: int, layout: str, arm: str) -> list[Cell]:
    """The cells this stage still needs for (digits, layout, arm), given the rows so far."""
    base = dict(digits=digits, layout=layout, arm=arm, steps=args.steps)
    if args.stage == "sweep":
        k = args.sweep_seeds
        ranked, by, partial = rate_choices(sweep_rows(rows, digits, layout, arm, args.steps, k), k, score, group_score)
        rates = rates_to_sweep(sorted({*args.grid, *partial}), ranked, by, args.extend)
        return [Cell(lr=lr, seed=s, **base) for lr in rates for s in range(k)]
    lr_digits = args.lr_digits or digits
    lr_steps = args.lr_steps or args.steps
    k = sweep_seeds_of(rows, lr_digits, layout, arm, lr_steps)
    ranked, by, partial = rate_choices(sweep_rows(rows, lr_digits, layout, arm, lr_steps, k), k, score, group_score)
    lr = args.lr or chosen_rate(
        [] if partial else ranked,
        by,
        args.grid,
        args.extend,
        f"{arm} at {lr_digits} digits ({layout} layout) and {lr_steps} steps",
        f"run --stage sweep --digits {lr_digits} --layouts {layout} --steps {lr_steps}"
        + (f" --sweep-seeds {k}" if k > 1 else "")
        + ", or give --lr",
    )
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    return [Cell(lr=lr, seed=s, **base) for s in seeds]


def train_run(cell: Cell, args: argparse.Namespace) -> dict:
    """Train one run (resuming a partial run dir), score its final checkpoint, and return its row."""
    base = load_recipe(args.recipe)
    targs = {"n_digits": cell.digits, "layout": cell.layout}
    task = get_task(TASK, seed=base.seed + cell.seed, **targs)
    overrides = [
        *arm_overrides(cell.arm),
        *seed_overrides(base.seed, cell.seed),
        f"optim.lr={cell.lr}",
        f"train.max_steps={cell.steps}",
        f"train.seq_len={task.max_len - 1}",
        f"model.max_seq_len={task.max_len - 1}",  # the reference's padded length, 3N + 4
        f"train.eval_every_steps={args.probe_every}",
        "data.task_args=" + json.dumps(targs),
    ]
    run = train_scored(
        args.recipe,
        overrides,
        Path(args.out) / "runs" / cell.name,
        task,
        args,
        ("exact_match", "acc", "loss"),
        may_diverge=True,
    )
    command = f"python -m studies.arithmetic --stage seeds --digits {cell.digits} --layouts {cell.layout}"
    command += f" --variants {cell.arm} --lr {cell.lr:g} --seed-list {cell.seed} --steps {cell.steps}"
    return {
        "command": command + (f" --recipe {shlex.quote(args.recipe)}" if args.recipe != RECIPE else ""),
        "recipe": args.recipe,
        "overrides": overrides,
        "task": TASK,
        "task_args": targs,
        "variant": split_arm(cell.arm)[0],
        "arm": cell.arm,
        "seed": cell.seed,
        "lr": cell.lr,
        "steps": cell.steps,
        "stage": args.stage,
        **run,
        "step_solved": first_step(run["curve"], SOLVED),
    }


def chosen_runs(rows: list[dict]) -> dict[tuple, list[dict]]:
    """{(digits, layout, steps, arm): its runs at the rate with the most seeds}; among rates with as many
    seeds, the one the sweep at those steps chose, else (the sweep, one seed each) the best by the sweep's
    order: exact match, token accuracy, loss (seed means). Diverged runs are left out (the sweep's table
    shows them)."""
    groups: dict[tuple, list[dict]] = {}
    for r in (r for r in rows if r["acc"] is not None):
        d, layout, arm, lr, _, steps = row_key(r)
        groups.setdefault((d, layout, steps, arm, lr), []).append(r)

    # with as many seeds at two rates (the ladder trains 1x again at the rate its 4x sweep chose), the rate
    # the sweep at these steps chose is the study's, whatever the other scored
    swept = {(d, lay, st, arm): sweep_choice(rows, d, lay, arm, st) for d, lay, st, arm, _ in groups}

    def rank(key: tuple, rs: list[dict]) -> tuple:
        means = [sum(x) / len(rs) for x in zip(*(score(r) for r in rs))]
        return (len(rs), key[4] == swept[key[:4]], *means)

    chosen: dict[tuple, tuple] = {}
    for key, rs in sorted(groups.items()):
        ranked = rank(key, rs)
        if key[:4] not in chosen or ranked > chosen[key[:4]][0]:
            chosen[key[:4]] = (ranked, sorted(rs, key=lambda r: r["seed"]))
    return {setting: rs for setting, (_, rs) in chosen.items()}


def render(rows: list[dict]) -> str:
    """Markdown: per (digits, layout, steps, arm) at its chosen rate (`chosen_runs`), exact match and token
    accuracy (mean ± std over seeds), every seed's exact match, how many solved it with the solve rate's
    95 % interval, and the step each one did; then the sweep."""
    if not rows:
        return "(no runs yet)"
    header = [
        "digits", "layout", "arm", "rate", "steps", "seeds", "exact match (mean ± std)", "per seed (%)",
        "token accuracy (the reference's measure)", "solved (≥ 90 %), 95 % interval", "step solved, per seed",
    ]  # fmt: skip
    table = []
    chosen = chosen_runs(rows)
    for (digits, layout, steps, arm), rs in sorted(chosen.items(), key=lambda kv: (*kv[0][:3], arm_order(kv[0][3]))):
        exact, acc = Spread.of(r["exact_match"] for r in rs), Spread.of(r["acc"] for r in rs)
        solved = [r["step_solved"] for r in rs]
        k = sum(s is not None for s in solved)
        lo, hi = wilson(k, len(rs))
        table.append(
            [
                digits, layout, arm, f"{rs[0]['lr']:g}", steps, len(rs), f"{100 * exact.mean:.1f} ± {100 * exact.std:.1f} %",
                ", ".join(f"{100 * r['exact_match']:.1f}" for r in rs), f"{100 * acc.mean:.1f} ± {100 * acc.std:.1f} %",
                f"{k}/{len(rs)} ({100 * lo:.0f}-{100 * hi:.0f} %)", ", ".join("—" if x is None else str(x) for x in solved),
            ]
        )  # fmt: skip
    md = markdown_table(header, table, align="rllrrrrlrrl")
    sweep = sorted(
        (r for r in rows if r.get("stage") == "sweep" and r["steps"] == STEPS_1X),  # the ladder's: its own table
        key=lambda r: (*row_key(r)[:2], arm_order(row_key(r)[2]), r["lr"]),
    )
    if sweep:
        lines = [
            [
                *row_key(r)[:3],
                f"{r['lr']:g}",
                *(
                    ["diverged", "—", "—"]
                    if r["acc"] is None
                    else [f"{100 * r['exact_match']:.1f} %", f"{100 * r['acc']:.1f} %", f"{r['loss']:.3f}"]
                ),
            ]
            for r in sweep
        ]
        header = ["digits", "layout", "arm", "rate", "exact match", "token accuracy", "loss"]
        md += "\n\nRate sweep (seed 0):\n\n" + markdown_table(header, lines, align="rllrrrr")
    spent = sum(r["cpu_s"] for r in rows)
    return (
        md
        + f"\n\n{len(rows)} runs, {spent / 3600:.2f} CPU-hours of training (`python -m studies.arithmetic --render`)."
    )


def sweep_choice(rows: list[dict], digits: int, layout: str, arm: str, steps: int) -> float | None:
    """The rate the sweep at these steps chose for the arm; None without a finished sweep there (or at an edge)."""
    args = argparse.Namespace(stage="seeds", steps=steps, lr=None, lr_digits=None, lr_steps=steps,
                              grid=list(GRID), extend=2, seed_list=[0], seeds=1)  # fmt: skip
    try:
        return cells_for(args, rows, digits, layout, arm)[0].lr
    except StudyError:
        return None


def ladder_rate(rows: list[dict], arm: str) -> float | None:
    """The rate an arm trains at on every rung of the ladder: the sweep's choice at the steps its LADDER
    entries name (MixiT's 4x sweep; standard's 1x one); None while that sweep is unfinished or at an edge."""
    lr_steps = next(ch["lr_steps"] for st, ch in LADDER if st == "seeds" and ch["variants"] == [arm])
    return sweep_choice(rows, 3, "reference", arm, lr_steps)


def verdict(standard: list[dict], mixit: list[dict]) -> str:
    """The page's rule (docs/results/arithmetic.md, written before the first runs), on one rung's seeds."""
    ks, km = sum(map(solved, standard)), sum(map(solved, mixit))
    es, em = Spread.of(r["exact_match"] for r in standard), Spread.of(r["exact_match"] for r in mixit)
    # solve fractions: the rule's km >= ks where both arms have 5 seeds, and fair where the cap left fewer
    if km * len(standard) >= ks * len(mixit) and abs(em.mean - es.mean) <= max(es.std, em.std, 0.05):
        return "holds"
    if 2 * ks > len(standard) and km <= 1:
        return "refuted"
    if 2 * ks <= len(standard):
        return "the budget decides nothing"
    return f"partly ({km}/{len(mixit)} against {ks}/{len(standard)})"


def render_ladder(rows: list[dict]) -> str:
    """Markdown: the budget ladder (3 digits, reference layout), per rung and arm at its ladder rate, the
    solve count with its 95 % interval, exact match and token accuracy over seeds, and the page's verdict
    where both arms have 5 seeds, or at least 3 once the rows hold LADDER_CPU_H; then MixiT's 4x sweep per rate."""
    rates = {arm: ladder_rate(rows, arm) for arm in LADDER_ARMS}
    capped = sum(r["cpu_s"] for r in rows) >= LADDER_CPU_H * 3600
    header = ["steps", "examples", "arm", "rate", "seeds", "solved (≥ 90 %), 95 % interval", "exact match (mean ± std)",
              "token accuracy", "step solved, per seed", f"verdict (5 seeds each, or what {LADDER_CPU_H} CPU-h left)"]  # fmt: skip
    table = []
    for steps in sorted({ch["steps"] for _, ch in LADDER} | {STEPS_1X}):
        runs = {
            arm: sorted((r for r in rows if row_key(r)[:3] == (3, "reference", arm) and r["steps"] == steps
                         and rates[arm] is not None and float(r["lr"]) == rates[arm] and r["acc"] is not None),
                        key=lambda r: r["seed"])[:5]
            for arm in LADDER_ARMS
        }  # fmt: skip
        seeds = [len(rs) for rs in runs.values()]
        said = verdict(runs["standard"], runs["mixit"]) if min(seeds) == 5 or (capped and min(seeds) >= 3) else "—"
        if said != "—" and min(seeds) < 5:
            said += f" (standard {seeds[0]}, MixiT {seeds[1]} seeds: the cap)"
        for arm, rs in runs.items():
            if not rs:
                table.append([steps, f"{steps * 256:,}", arm, f"{rates[arm]:g}" if rates[arm] else "—", 0] + ["—"] * 5)
                continue
            k = sum(map(solved, rs))
            lo, hi = wilson(k, len(rs))
            exact, acc = Spread.of(r["exact_match"] for r in rs), Spread.of(r["acc"] for r in rs)
            table.append([
                steps, f"{steps * 256:,}", arm, f"{rates[arm]:g}", len(rs), f"{k}/{len(rs)} ({100 * lo:.0f}-{100 * hi:.0f} %)",
                f"{100 * exact.mean:.1f} ± {100 * exact.std:.1f} %", f"{100 * acc.mean:.1f} ± {100 * acc.std:.1f} %",
                ", ".join("—" if r["step_solved"] is None else str(r["step_solved"]) for r in rs),
                said if arm == "mixit" else "",
            ])  # fmt: skip
    md = markdown_table(header, table, align="rrllrrrrll")
    steps4 = next(ch["steps"] for st, ch in LADDER if st == "sweep")
    swept = [r for r in rows if r.get("stage") == "sweep" and row_key(r)[:3] == (3, "reference", "mixit")
             and r["steps"] == steps4]  # fmt: skip
    lines = []
    for lr in sorted({float(r["lr"]) for r in swept}):
        rs = sorted((r for r in swept if float(r["lr"]) == lr), key=lambda r: r["seed"])
        _, loss = group_score({"runs": rs})
        lines.append([
            f"{lr:g}", len(rs), sum(map(solved, rs)), ", ".join("diverged" if r["acc"] is None else
                                                                f"{100 * r['exact_match']:.1f}" for r in rs),
            f"{-loss:.3f}",
        ])  # fmt: skip
    if lines:
        md += f"\n\nMixiT's rate sweep at {steps4} steps (seeds 0-2 per rate; ranked by seeds solved, then mean loss):\n\n"
        md += markdown_table(["rate", "seeds", "solved", "exact match per seed (%)", "mean held-out loss"], lines,
                             align="rrrlr")  # fmt: skip
    return md


def run_stage(args: argparse.Namespace, log=print) -> int | None:
    """Train every missing cell of the stage, one at a time (seed-major); returns how many were trained
    (None: the CPU budget is spent)."""

    def todo_of(rows: list[dict]) -> list[Cell]:
        done = {row_key(r) for r in rows}
        todo = [
            c
            for d in args.digits
            for lay in args.layouts
            for a in args.variants
            for c in cells_for(args, rows, d, lay, a)
        ]
        todo = [c for c in todo if c.key() not in done]
        return sorted(todo, key=lambda c: (c.seed, c.digits, c.layout, args.variants.index(c.arm), c.lr))

    def result(row: dict) -> str:
        return (
            "diverged"
            if row["acc"] is None
            else f"exact match {row['exact_match']:.3f}, token accuracy {row['acc']:.3f}"
        )

    return train_missing(
        args.stage, Path(args.rows), args.budget_cpu_h, todo_of, lambda c: train_run(c, args), result, log
    )


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.arithmetic", __doc__)
    ap.add_argument(
        "--stage",
        choices=("sweep", "seeds", "all", "ladder"),
        default="seeds",
        help="all: the PLAN; ladder: the LADDER",
    )
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--digits", type=ints, default=[3], help="comma-separated operand lengths")
    ap.add_argument("--layouts", type=names, default=list(LAYOUTS), help=f"comma-separated, from {list(LAYOUTS)}")
    ap.add_argument(
        "--variants", type=names, default=ARMS, help="arms: VARIANT or VARIANT@STD (its Q/K initialised at STD)"
    )
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    ap.add_argument("--seed-list", type=ints, help="exactly these seed indices (overrides --seeds)")
    ap.add_argument("--steps", type=int, default=STEPS_1X)
    ap.add_argument("--sweep-seeds", type=int, default=1, help="sweep: seeds 0..K-1 at every rate")
    ap.add_argument("--lr-steps", type=int, help="seeds: the best rate of the sweep at this many steps")
    ap.add_argument("--grid", type=floats, default=list(GRID), help="the sweep's rates")
    ap.add_argument("--extend", type=int, default=2, help="rates the sweep may add beyond an edge")
    ap.add_argument("--lr", type=float, help="seeds: this rate instead of the sweep's best")
    ap.add_argument("--lr-digits", type=int, help="seeds: the best rate of the sweep at this many digits")
    ap.add_argument("--probe-every", type=int, default=125, help="steps between held-out exact-match probes")
    ap.add_argument("--probe-samples", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=4000, help="held-out sums the final checkpoint is scored on")
    ap.add_argument(
        "--budget-cpu-h", type=float, default=6.0, help="stop training once the rows hold this many CPU-hours"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--out", default="outputs/arithmetic", help="scratch run dirs")
    ap.add_argument("--render", action="store_true", help="train nothing; print the table of the rows")
    args = ap.parse_args(argv)

    def body() -> int:
        check_variants(args.variants)
        for d in args.digits:
            for layout in args.layouts:
                get_task(TASK, n_digits=d, layout=layout)  # an impossible setting is one error line before any training
        if not args.render:
            torch.set_num_threads(args.threads)
            plans = {"all": PLAN, "ladder": tuple((st, {**LADDER_COMMON, **ch}) for st, ch in LADDER)}
            stages = plans.get(args.stage, [(args.stage, {})])
            for stage, changes in stages:
                if run_stage(argparse.Namespace(**{**vars(args), "stage": stage, **changes})) is None:
                    break
        print(render(read_rows(Path(args.rows))))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
