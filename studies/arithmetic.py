"""Multi-digit addition, the paper's other half: does MixiT match standard where nothing is retrieved?

    python -m studies.arithmetic --digits 2,3 --seeds 5      # 2 tasks x 3 variants x 5 seeds, one row per run
    python -m studies.arithmetic --render                    # the table from the rows, nothing trained
    python -m studies.results_page render                    # docs/results/arithmetic.md from the same rows

Trains recipes/paper_addition.yaml (reversed decimal addition in the paper's format, `rev(a)+rev(b)=rev(a+b)
<eos>`, the sum and <eos> scored) at each --digits, standard / frozen_qk / mixit, every variant at the
recipe's rate, one run at a time in this process, with a hook (pretrain/hooks.py) scoring held-out exact
match (every answer token right) every --probe-every steps; the final checkpoint is scored on
--eval-samples held-out sums (eval/run.py). Each finished run appends its row (`train_run`; `step_solved`: the
first probed step at >= 90 % exact match, None: not within the budget) to --rows (JSONL); a run whose row
exists is skipped, so the command resumes from the committed rows; run dirs under --out are scratch.
Seed i trains with the recipe's seed + i (init, data order, the held-out draw) and MixiT matrices of seed i.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from common.cli import ints, run_cli
from data_pipeline.synthetic import get_task
from eval.report import markdown_table
from model import VARIANTS
from pretrain.config import load_recipe

from .retrieval import first_step, train_scored
from .rows import append_row, read_rows
from .shared import check_variants, names, study_parser
from .spread import Spread

RECIPE = "recipes/paper_addition.yaml"
ROWS = "docs/data/arithmetic/runs.jsonl"
TASK = "addition"
SOLVED = 0.9  # held-out exact match that counts as solved
DEFAULT_VARIANTS = ("standard", "frozen_qk", "mixit")


def run_name(digits: int, variant: str, seed: int, steps: int, extra: Sequence[str] = ()) -> str:
    """The run dir's name; an arm with overrides of its own gets their hash, so it never resumes another's run."""
    tag = "-" + hashlib.sha256("\n".join(extra).encode()).hexdigest()[:8] if extra else ""
    return f"d{digits}-{variant}{tag}-s{seed}-n{steps}"


def row_key(r: dict) -> tuple:
    return (r["task_args"]["n_digits"], r["variant"], r["seed"], r["steps"], r["lr"], tuple(r.get("extra", ())))


def arm(r: dict) -> str:
    """The variant and the overrides every run of its command added (--override), as the table names it."""
    return r["variant"] + "".join(f" {o}" for o in r.get("extra", ()))


def train_run(digits: int, variant: str, seed: int, args: argparse.Namespace) -> dict:
    """Train one run (resuming a partial run dir), score its final checkpoint, and return its row."""
    base = load_recipe(args.recipe)
    targs = {"n_digits": digits}
    seq_len = get_task(TASK, **targs).max_len
    overrides = [
        f"model.variant={variant}",
        f"model.mixit_seed={seed}",
        f"seed={base.seed + seed}",
        f"train.max_steps={args.steps}",
        f"train.seq_len={seq_len}",
        f"model.max_seq_len={seq_len}",
        f"train.eval_every_steps={args.probe_every}",
        f"checkpoint.every_steps={max(args.probe_every, args.steps // 4)}",
        "data.task_args=" + json.dumps(targs),
        *args.override,
    ]
    lr = load_recipe(args.recipe, overrides).optim.lr
    run_dir = Path(args.out) / "runs" / run_name(digits, variant, seed, args.steps, args.override)
    task = get_task(TASK, seed=base.seed + seed, **targs)
    run = train_scored(args.recipe, overrides, run_dir, task, args, keys=("exact_match", "acc", "loss"))
    command = f"python -m studies.arithmetic --digits {digits} --variants {variant} --seed-list {seed}"
    command += f" --steps {args.steps}" + "".join(f" --override {o}" for o in args.override)
    return {
        "command": command + (f" --recipe {args.recipe}" if args.recipe != RECIPE else ""),
        "extra": list(args.override),
        "recipe": args.recipe,
        "overrides": overrides,
        "task": TASK,
        "task_args": targs,
        "variant": variant,
        "seed": seed,
        "lr": lr,
        "steps": args.steps,
        **run,
        "step_solved": first_step(run["curve"], SOLVED),
    }


def render(rows: list[dict]) -> str:
    """Markdown: per (digits, steps, variant), exact match and token accuracy as mean ± std over seeds,
    every seed's exact match, how many solved it and the step each one did."""
    header = [
        "digits", "variant", "rate", "steps", "seeds", "exact match (mean ± std)", "per seed (%)",
        "token accuracy", "solved (≥ 90 %)", "step solved, per seed",
    ]  # fmt: skip
    table = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task_args"]["n_digits"], r["steps"], arm(r), r["lr"]), []).append(r)
    order = list(VARIANTS)
    for (digits, steps, variant, lr), rs in sorted(
        groups.items(), key=lambda kv: (*kv[0][:2], order.index(kv[0][2].split()[0]), kv[0][2])
    ):
        rs = sorted(rs, key=lambda r: r["seed"])
        exact, acc = Spread.of(r["exact_match"] for r in rs), Spread.of(r["acc"] for r in rs)
        solved = [r["step_solved"] for r in rs]
        per_seed = ", ".join(f"{100 * r['exact_match']:.1f}" for r in rs)
        steps_solved = ", ".join("—" if x is None else str(x) for x in solved)
        table.append(
            [
                digits, variant, f"{lr:g}", steps, len(rs), f"{100 * exact.mean:.1f} ± {100 * exact.std:.1f} %",
                per_seed, f"{100 * acc.mean:.1f} ± {100 * acc.std:.1f} %",
                f"{sum(s is not None for s in solved)}/{len(rs)}", steps_solved,
            ]
        )  # fmt: skip
    spent = sum(r["cpu_s"] for r in rows)
    md = markdown_table(header, table, align="rlrrrrlrrl")
    return md + f"\n\n{len(rows)} runs, {spent / 3600:.2f} CPU-hours of training."


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.arithmetic", __doc__)
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--digits", type=ints, default=[2, 3], help="comma-separated operand lengths")
    ap.add_argument("--variants", type=names, default=list(DEFAULT_VARIANTS))
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    ap.add_argument("--seed-list", type=ints, help="exactly these seed indices (overrides --seeds)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--probe-every", type=int, default=100, help="steps between held-out exact-match probes")
    ap.add_argument("--probe-samples", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=2000, help="held-out sums the final checkpoint is scored on")
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--out", default="outputs/arithmetic", help="scratch run dirs")
    ap.add_argument("--render", action="store_true", help="train nothing; print the table of the rows")
    ap.add_argument("--override", action="append", default=[], help="a recipe override for every run (repeatable)")
    args = ap.parse_args(argv)

    def body() -> int:
        check_variants(args.variants)
        for d in args.digits:
            get_task(TASK, n_digits=d)  # an impossible length is one error line before any training
        rows_path = Path(args.rows)
        if not args.render:
            seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
            lr = {v: load_recipe(args.recipe, [f"model.variant={v}", *args.override]).optim.lr for v in args.variants}
            todo = [(d, v, s) for d in args.digits for s in seeds for v in args.variants]  # seed-major
            for d, v, s in todo:
                done = {row_key(r) for r in read_rows(rows_path)}
                if (d, v, s, args.steps, lr[v], tuple(args.override)) in done:
                    continue
                print(f"[arithmetic] {run_name(d, v, s, args.steps, args.override)}: training")
                row = train_run(d, v, s, args)
                append_row(rows_path, row)
                print(
                    f"[arithmetic] {run_name(d, v, s, args.steps, args.override)}: exact match {row['exact_match']:.3f}, "
                    f"solved at {row['step_solved']}, {row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} s CPU"
                )
        print(render(read_rows(rows_path)))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
