"""Parity with the reference implementation on its own tasks and settings, side by side with its numbers.

    python -m studies.parity --seeds 3                 # 3 tasks x 3 variants x 3 seeds, one row per run
    python -m studies.parity --tasks additionstream_3 --variants mixit --seed-list 3,4
    python -m studies.parity --render                  # the table from the rows, nothing trained

Each task is the reference's (princeton-pli/MixiT, its algorithmic tasks from random_transformers) in
this project's generator, trained with the reference's settings (recipes/reference_*.yaml: 2 layers,
width 64, AdamW 1e-2, 500 warm-up steps, cosine to 0, weight decay 1e-3, clipping 1.0, batch 256, every
matrix and Q/K at N(0, 0.02), MixiT with the reference's companions and width factors):

- condattendstream_8: 1-8 key-value pairs, keys from the 8 pairs' symbols, 255 values, the queried key
  as its own token; 1562 steps; scored: the value.
- additionstream_3 / _5: reversed addition of exactly N-digit operands, answer digits as their own
  tokens; 1250 steps; scored as the reference scores: the answer tokens after the first, the stop token
  and the pad after it (N + 1 per example).

The final checkpoint is scored on --eval-samples held-out examples (the reference: 4000): `acc` is the
reference's metric (token accuracy over the scored positions), `exact_match` every scored token of an
example right. Each finished run appends its row to --rows; a run whose row exists is skipped. Seed i
trains with the recipe's seed + i (init, data order, the held-out draw) and MixiT matrices of seed i.
The reference's numbers come from docs/data/parity/reference.jsonl, rows that say how each was measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from common.cli import ints, run_cli
from common.errors import StudyError
from data_pipeline.synthetic import get_task
from eval.report import markdown_table
from model import VARIANTS
from pretrain.config import load_recipe

from .retrieval import train_scored
from .rows import append_row, read_rows
from .shared import check_variants, names, seed_overrides, study_parser
from .spread import Spread

ROWS = "docs/data/parity/runs.jsonl"
REFERENCE_ROWS = "docs/data/parity/reference.jsonl"
KEYS = ("acc", "exact_match", "loss")
SOLVED = 0.99  # token accuracy that counts a seed as having solved the task


@dataclass(frozen=True)
class RefTask:
    """One of the reference's tasks: the recipe that trains it, its arguments, its padded length T (the
    reference's sequence length, which sets MixiT's matrix) and its step count."""

    recipe: str
    task: str
    args: dict
    T: int
    steps: int


TASKS = {
    "condattendstream_8": RefTask(
        "recipes/reference_condattend.yaml",
        "kv_retrieval",
        {"n_pairs": 8, "min_pairs": 1, "n_keys": 8, "n_values": 255, "query": "token"},
        2 * 8 + 3,
        1562,
    ),
    **{
        f"additionstream_{n}": RefTask(
            "recipes/reference_addition.yaml", "addition", {"n_digits": n, "layout": "reference"}, 3 * n + 4, 1250
        )
        for n in (3, 5)
    },
}


def row_key(r: dict) -> tuple:
    return (r["ref_task"], r["variant"], r["seed"], r["steps"], tuple(r.get("extra", ())))


def train_run(name: str, variant: str, seed: int, args: argparse.Namespace) -> dict:
    """Train one run (resuming a partial run dir), score its final checkpoint, and return its row."""
    spec = TASKS[name]
    base = load_recipe(spec.recipe)
    task = get_task(spec.task, seed=base.seed + seed, **spec.args)
    overrides = [
        f"model.variant={variant}",
        *seed_overrides(base.seed, seed),
        f"train.max_steps={spec.steps}",
        f"train.seq_len={task.max_len - 1}",
        f"model.max_seq_len={spec.T}",
        f"train.eval_every_steps={args.probe_every}",
        "data.task_args=" + json.dumps(spec.args),
        *args.override,
    ]
    run_dir = Path(args.out) / "runs" / f"{name}-{variant}-s{seed}"
    run = train_scored(spec.recipe, overrides, run_dir, task, args, keys=KEYS)
    command = f"python -m studies.parity --tasks {name} --variants {variant} --seed-list {seed}"
    command += "".join(f" --override {o}" for o in args.override)
    return {
        "command": command,
        "ref_task": name,
        "recipe": spec.recipe,
        "overrides": overrides,
        "extra": list(args.override),
        "task": spec.task,
        "task_args": task.args,
        "variant": variant,
        "seed": seed,
        "lr": load_recipe(spec.recipe, overrides).optim.lr,
        "steps": spec.steps,
        **run,
    }


def render(rows: list[dict], reference: list[dict]) -> str:
    """Markdown: per task and variant, our token accuracy (mean ± std, every seed) and exact match beside
    the reference's token accuracy per seed, and whether the gap exceeds the seeds' spread."""
    header = [
        "task", "variant", "seeds", "ours: token accuracy (mean ± std)", "ours, per seed", "ours: exact match",
        "reference: token accuracy, per seed", "gap beyond the spread?", "solved (≥ 0.99): ours, reference",
    ]  # fmt: skip
    table = []
    order = list(VARIANTS)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["ref_task"], r["variant"], tuple(r.get("extra", ()))), []).append(r)
    for (name, variant, extra), rs in sorted(
        groups.items(), key=lambda kv: (list(TASKS).index(kv[0][0]), order.index(kv[0][1]), kv[0][2])
    ):
        rs = sorted(rs, key=lambda r: r["seed"])
        acc, exact = Spread.of(r["acc"] for r in rs), Spread.of(r["exact_match"] for r in rs)
        ref = [x["acc"] for x in reference if x["ref_task"] == name and x["variant"] == variant] if not extra else []
        table.append(
            [
                name, variant + "".join(f" {o}" for o in extra), len(rs), acc.format(),
                ", ".join(f"{v:.3f}" for v in acc.values), exact.format(),
                ", ".join(f"{v:.3f}" for v in ref) or "—", gap_verdict(acc, ref) if ref else "—",
                f"{solved(acc.values)}/{len(rs)}, " + (f"{solved(ref)}/{len(ref)}" if ref else "—"),
            ]
        )  # fmt: skip
    spent = sum(r["cpu_s"] for r in rows)
    md = markdown_table(header, table, align="llrrlrllr")
    return md + f"\n\n{len(rows)} runs, {spent / 3600:.2f} CPU-hours of training (`python -m studies.parity --render`)."


def solved(values) -> int:
    """Seeds at token accuracy >= SOLVED: the comparable number where the outcome is bimodal over seeds."""
    return sum(v >= SOLVED for v in values)


def gap_verdict(ours: Spread, reference: list[float]) -> str:
    """'no' when the reference's values and ours overlap (each range widened by the other side's spread,
    at least 0.01), else 'yes' with the gap of the means: the rule the page applies to every cell."""
    ref = Spread.of(reference)
    slack = max(ours.std, ref.std, 0.01)
    if ours.lo - slack <= ref.hi and ref.lo - slack <= ours.hi:
        return "no"
    return f"yes ({ours.mean - ref.mean:+.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.parity", __doc__)
    ap.add_argument("--tasks", type=names, default=list(TASKS), help=f"comma-separated, from {list(TASKS)}")
    ap.add_argument("--variants", type=names, default=["standard", "frozen_qk", "mixit"])
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    ap.add_argument("--seed-list", type=ints, help="exactly these seed indices (overrides --seeds)")
    ap.add_argument("--probe-every", type=int, default=250, help="steps between held-out probes")
    ap.add_argument("--probe-samples", type=int, default=256)
    ap.add_argument(
        "--eval-samples", type=int, default=4000, help="held-out examples the final checkpoint is scored on"
    )
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--reference-rows", default=REFERENCE_ROWS)
    ap.add_argument("--out", default="outputs/parity", help="scratch run dirs")
    ap.add_argument("--render", action="store_true", help="train nothing; print the table of the rows")
    ap.add_argument("--override", action="append", default=[], help="a recipe override for every run (repeatable)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)

    def body() -> int:
        check_variants(args.variants)
        unknown = [t for t in args.tasks if t not in TASKS]
        if unknown:
            raise StudyError(f"unknown tasks {unknown}. Fix: choose from {list(TASKS)}")
        rows_path = Path(args.rows)
        if not args.render:
            torch.set_num_threads(args.threads)
            seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
            for s in seeds:  # seed-major: a session cut short leaves every variant with the same seeds
                for name in args.tasks:
                    for v in args.variants:
                        if (name, v, s, TASKS[name].steps, tuple(args.override)) in {
                            row_key(r) for r in read_rows(rows_path)
                        }:
                            continue
                        print(f"[parity] {name} {v} seed {s}: training", flush=True)
                        row = train_run(name, v, s, args)
                        append_row(rows_path, row)
                        print(
                            f"[parity] {name} {v} seed {s}: acc {row['acc']:.4f}, exact {row['exact_match']:.4f}, "
                            f"{row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} s CPU",
                            flush=True,
                        )
        print(render(read_rows(rows_path), read_rows(args.reference_rows)))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
