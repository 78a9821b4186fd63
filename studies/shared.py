"""What several studies share: their command line's parser and list options, the variant check, the
check that a training run reached its end, and their figures' labels."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.cli import CliParser
from common.errors import StudyError
from model import VARIANTS

from .rows import append_row, read_rows


def study_parser(module: str, doc: str) -> CliParser:
    """`python -m MODULE`'s parser: the docstring's first paragraph above the options, all of it below."""
    return CliParser(
        prog=f"python -m {module}",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc,
    )


def names(text: str) -> list[str]:
    """'standard,mixit' -> ['standard', 'mixit'] (empty items dropped)."""
    return [x for x in text.split(",") if x]


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 16,32)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need positive integers (e.g. 16,32)")
    return values


def without(argv: list[str], *options: str) -> list[str]:
    """`argv` less the given options and their values (`--opt V` or `--opt=V`)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in options:
            skip = True
        elif not any(x.startswith(o + "=") for o in options):
            out.append(x)
    return out


def split_arm(arm: str) -> tuple[str, float | None]:
    """A study arm, `VARIANT` or `VARIANT@STD` (Q/K initialised at that std, e.g. `standard@0.02`), as
    (variant, std); None: the default Q/K init, the paper's rule for frozen Q/K (1/sqrt(hidden size))."""
    variant, at, std = arm.partition("@")
    if not at:
        return variant, None
    try:
        return variant, float(std)
    except ValueError:
        raise StudyError(f"arm {arm!r}: {std!r} is not a number. Fix: write VARIANT@STD, e.g. standard@0.02") from None


def arm_overrides(arm: str) -> list[str]:
    """The recipe overrides that make an arm: its variant and its Q/K init, the named one or the default
    (`null`: 1/sqrt(hidden size)), whatever the recipe sets (the reference's recipes set 0.02), so that
    `standard` and `standard@0.02` differ in their init on every recipe."""
    variant, std = split_arm(arm)
    return [f"model.variant={variant}", f"model.qk_init_std={'null' if std is None else std}"]


def arm_order(arm: str) -> tuple[int, float]:
    """Arms in the order of VARIANTS, the default Q/K init before the named ones."""
    variant, std = split_arm(arm)
    return list(VARIANTS).index(variant), -1.0 if std is None else std


def check_variants(arms: list[str]) -> None:
    """Every arm names a known variant (and, with @STD, a positive Q/K std of a variant that has Q/K)."""
    for arm in arms:
        v, std = split_arm(arm)
        if v not in VARIANTS:
            raise StudyError(f"unknown variant {v!r}. Fix: choose from {sorted(VARIANTS)}")
        if std is not None and (std <= 0 or v == "mixit"):
            raise StudyError(
                f"arm {arm!r}: a Q/K std needs a positive value and a variant with Q/K. Fix: e.g. standard@0.02"
            )


def label_axes(ax, xlabel: str, ylabel: str, title: str | None = None, grid: bool = True) -> None:
    """A panel's axis labels, its title, its legend and a light grid."""
    ax.set(xlabel=xlabel, ylabel=ylabel)
    if title is not None:
        ax.set_title(title, fontsize=10)
    if grid:
        ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def ran_to_end(res, run_dir):
    """`res`, the result of `pretrain.train.train` into `run_dir`, when the run reached its end."""
    if res.interrupted:  # a signal: the checkpoint is saved, the run is not finished
        raise StudyError(
            f"{run_dir} was interrupted at step {res.final_step} (a checkpoint was saved). Fix: run the same "
            "command again to resume it"
        )
    return res


def best_rate(swept: list[dict], score: Callable[[dict], tuple]) -> tuple[float | None, list[float]]:
    """(the rate of the best of a sweep's rows by `score`, every rate swept); None when nothing was swept."""
    if not swept:
        return None, []
    return float(max(swept, key=score)["lr"]), sorted({float(r["lr"]) for r in swept})


def rates_to_sweep(grid: list[float], swept: list[dict], score: Callable[[dict], tuple], extend: int) -> list[float]:
    """The rates a sweep needs: the grid and every rate already swept, and, once all of them are swept and
    the best sits at an edge, the next rate beyond it by x3 (at most `extend` rates beyond the grid)."""
    best, rates = best_rate(swept, score)
    todo = sorted(set(grid) | set(rates))
    if best is not None and set(todo) == set(rates) and len(set(rates) - set(grid)) < extend:
        if best == min(rates):
            todo.append(float(f"{best / 3:.3g}"))
        elif best == max(rates):
            todo.append(float(f"{best * 3:.3g}"))
    return todo


def rate_choices(
    swept: list[dict], seeds: int, score: Callable[[dict], tuple], group_score: Callable[[dict], tuple]
) -> tuple[list[dict], Callable[[dict], tuple], list[float]]:
    """A sweep as `rates_to_sweep` and `chosen_rate` rank it: with one seed per rate, its rows by `score`;
    with several, one entry {"lr", "runs"} per rate whose seeds are all in, by `group_score`, and the rates
    still missing a seed, which the sweep finishes before it ranks or grows."""
    if seeds == 1:
        return swept, score, []
    by_rate: dict[float, list[dict]] = {}
    for r in swept:
        by_rate.setdefault(float(r["lr"]), []).append(r)
    complete = [{"lr": lr, "runs": rs} for lr, rs in sorted(by_rate.items()) if len(rs) == seeds]
    return complete, group_score, [lr for lr, rs in by_rate.items() if len(rs) < seeds]


def chosen_rate(
    swept: list[dict], score: Callable[[dict], tuple], grid: list[float], extend: int, what: str, fix: str
) -> float:
    """The sweep's best rate for the seeds that follow it. Refused while it sits at an edge of a grid that
    may still grow (an optimum at an edge is not an optimum); `fix` says which sweep to run."""
    best, rates = best_rate(swept, score)
    if best is None:
        raise StudyError(f"no sweep rows for {what}. Fix: {fix}")
    if best in (min(rates), max(rates)) and len(rates) < len(grid) + extend:
        raise StudyError(
            f"{what}: the best rate {best:g} is at the edge of {rates}. Fix: {fix} again to extend the grid"
        )
    return best


def seed_overrides(recipe_seed: int, i: int) -> list[str]:
    """Seed i of every study: the recipe's seed + i (init, data order, a synthetic task's content and its
    held-out draw) and MixiT matrices of seed i."""
    return [f"seed={recipe_seed + i}", f"model.mixit_seed={i}"]


def train_missing(
    stage: str,
    rows_path: Path,
    budget_cpu_h: float,
    todo_of: Callable[[list[dict]], list],
    train_one: Callable[[Any], dict],
    result: Callable[[dict], str],
    log=print,
) -> int | None:
    """Train a stage's missing cells one at a time, in `todo_of(rows)`'s order, read again after every run
    (a sweep may grow its grid), each row appended as it finishes; returns how many were trained (None:
    the rows already hold `budget_cpu_h` CPU-hours, so the stage stopped)."""
    trained = 0
    while True:
        rows = read_rows(rows_path)
        todo = todo_of(rows)
        if not todo:
            log(f"[{stage}] nothing left to train ({len(rows)} rows in {rows_path})")
            return trained
        spent = sum(r["cpu_s"] for r in rows)
        if spent >= budget_cpu_h * 3600:
            log(f"[{stage}] CPU budget spent ({spent / 3600:.2f} h of {budget_cpu_h} h); {len(todo)} cells left")
            return None
        cell = todo[0]
        log(f"[{stage}] {cell.name}: training ({len(todo)} cells left, {spent / 3600:.2f} CPU-h spent)")
        row = train_one(cell)
        append_row(rows_path, row)
        trained += 1
        log(
            f"[{stage}] {cell.name}: {result(row)}, solved at {row['step_solved']}, "
            f"{row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} s CPU"
        )
