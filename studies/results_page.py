"""The results pages' tables, rendered from the data rows under docs/data, so that no number in a
table is typed by hand.

    python -m studies.results_page render            # rewrite every table between its markers
    python -m studies.results_page render --check    # exit 1, naming the table, if a page disagrees

A table sits in docs/RESULTS.md or docs/results/*.md between `<!-- table:NAME -->` and
`<!-- /table:NAME -->`; NAME is one of TABLES below. The rows: each `docs/data/capacity_*/capacity.json`
as `python -m studies.capacity --gather` wrote it (one row per cell: variant, width, steps, seed index,
the recipe and its overrides, bits, accuracy, loss), `docs/data/claims.csv` (the summary: the paper's
claims, where the paper states them, the verdict, the command that measures them) and
`docs/data/rows_lost.csv` (results whose rows were not kept, with the command that re-measures them),
`docs/data/retrieval/runs.jsonl`, `docs/data/arithmetic/runs.jsonl` and `docs/data/induction/runs.jsonl`
(one row per run, as the studies write them), and one GPU run's benchmark tables (the speed claim).
Means and sample standard deviations over seeds are computed here. The check also fails on a
markdown table outside any marker pair, so a hand-typed table cannot slip in.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from common.cli import CliParser, print_error, run_cli
from common.constants import REPO_ROOT
from common.errors import StudyError
from eval.report import markdown_table
from pretrain.config import load_recipe

from . import arithmetic, induction, induction_checkpoints, parity, retrieval
from .rows import read_rows
from .scaling.profiles import paired_gaps
from .spread import Spread

# the (pairs, values) docs/results/retrieval.md gives baselines for
# (and the README demo's 1-4 pairs of 8 keys and 8 values)
RETRIEVAL_BASELINES = [(4, 8, 8)] + [(p, 32, 32) for p in (4, 8, 12, 16, 30)] + [(16, 32, 255), (30, 32, 255)]
VARIANT_ORDER = ("standard", "frozen_qk", "mixit", "frozen_mlp")
VARIANT_NAMES = {"standard": "standard", "frozen_qk": "frozen-QK", "mixit": "MixiT", "frozen_mlp": "frozen-MLP"}
MARKER = re.compile(r"<!-- table:([\w-]+) -->\n(.*?)<!-- /table:\1 -->", re.S)
CLAIM_COLUMNS = ("claim", "paper", "where", "ours", "verdict", "page", "command")
VERDICTS = ("reproduced", "partly", "not reproduced", "not measured")


# ---- the rows ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One capacity run: what trained it and what it stored."""

    study: str  # the docs/data directory holding its row
    variant: str
    width: int
    steps: int
    weights_seed: int  # seed index of the initial weights and data order (the recipe's seed + it)
    matrices_seed: int  # MixiT's mixing matrices (model.mixit_seed)
    lr: float
    min_lr: float
    bits_per_trainable_param: float
    bits: float
    acc: float
    loss_drop: float  # training loss fallen over the last 20% of steps
    command: str


def _override(overrides: list[str], key: str) -> str | None:
    found = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return found[-1] if found else None


SIZE_AND_VARIANT = 5  # studies.capacity appends hidden, intermediate, heads, kv heads and the variant


def study_command(recipe: str, row: dict, overrides: list[str], study: str) -> str:
    """The studies.capacity command that trains and scores this one cell: the row's overrides without
    the ones the study adds itself (size, variant, and for seed index i > 0 `seed` and `model.mixit_seed`)."""
    own = overrides[: len(overrides) - SIZE_AND_VARIANT - (2 if int(row["seed_index"]) else 0)]
    return (
        f"python -m studies.capacity --recipe {recipe} --variants {row['variant']} --widths {row['width']} "
        f"--seeds 1 --first-seed {row['seed_index']} --out-dir outputs/{study} " + " ".join(own)
    ).strip()


def read_capacity(data_dir: Path, repo: Path = REPO_ROOT) -> list[Cell]:
    """Every row of every docs/data/capacity_*/capacity.json, with its seeds and rates resolved from the
    recipe and the row's overrides."""
    cells, recipes = [], {}
    for path in sorted(Path(data_dir).glob("capacity_*/capacity.json")):
        try:
            rows = json.loads(path.read_text())
            for r in rows:
                over, recipe = list(r["overrides"]), r["recipe"]
                if recipe not in recipes:
                    recipes[recipe] = load_recipe(repo / recipe).seed
                run = load_recipe(repo / recipe, over)
                weights = run.seed - recipes[recipe] if _override(over, "seed") else int(r["seed_index"])
                cells.append(
                    Cell(
                        study=path.parent.name,
                        variant=r["variant"],
                        width=int(r["width"]),
                        steps=int(r["steps"]),
                        weights_seed=weights,
                        matrices_seed=int(run.model.fields.get("mixit_seed", 0)),
                        lr=run.optim.lr,
                        min_lr=run.optim.min_lr,
                        bits_per_trainable_param=float(r["bits_per_trainable_param"]),
                        bits=float(r["bits"]),
                        acc=float(r["acc"]),
                        loss_drop=float(r["loss_drop_last_20pct"]),
                        command=study_command(recipe, r, over, path.parent.name),
                    )
                )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise StudyError(
                f"{path}: not a capacity study's row list ({type(e).__name__}: {e}). Fix: restore it from git "
                "or write it again with python -m studies.capacity --gather"
            ) from None
    if not cells:
        raise StudyError(f"{data_dir} holds no capacity_*/capacity.json. Fix: pass the repository's docs/data")
    return cells


def read_csv(path: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise StudyError(f"{path}: {e.strerror}. Fix: restore it from git") from None
    if not rows or any(set(columns) - set(r) or None in r for r in rows):
        raise StudyError(
            f"{path}: needs the columns {', '.join(columns)} in every row, and no more (a field with a comma "
            "needs quotes). Fix: restore it from git"
        )
    return rows


# ---- numbers over seeds ---------------------------------------------------------------------------
def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0 for one value)."""
    s = Spread.of(values)
    return s.mean, s.std


def spread(values: list[float], digits: int = 3) -> str:
    """'1.354 ± 0.026' over several values, '1.354' for one."""
    return Spread.of(values).format(f"{{:.{digits}f}}")


def _table(header: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    """A page's table: numbers right-aligned from column `right_from`, a newline after every line."""
    return markdown_table(header, rows, right_from) + "\n"


# ---- capacity tables --------------------------------------------------------------------------------

RECIPE_RATES = (1e-2, 1e-3)  # recipes/capacity_memorization.yaml: peak rate and its floor


def _recipe_runs(cells: list[Cell]) -> list[Cell]:
    """The recipe's rates, each seed's own matrices (not the swapped draws)."""
    return [c for c in cells if (c.lr, c.min_lr) == RECIPE_RATES and c.weights_seed == c.matrices_seed]


def _by(cells: list[Cell], variant: str, steps: int) -> list[Cell]:
    found = {c.weights_seed: c for c in cells if c.variant == variant and c.steps == steps}
    return [found[s] for s in sorted(found)]


def headline_cells(cells: list[Cell]) -> dict[str, list[Cell]]:
    """Each variant at its longest length with three or more seeds, at the recipe's rates."""
    runs, out = _recipe_runs(cells), {}
    for v in VARIANT_ORDER:
        lengths = sorted({c.steps for c in runs if c.variant == v and len(_by(runs, v, c.steps)) >= 3})
        if lengths:
            out[v] = _by(runs, v, lengths[-1])
    return out


def paper_bits(data_dir: Path) -> dict[str, float]:
    """The paper's bits per parameter, from the capacity claim's `paper` cell in claims.csv."""
    for c in read_csv(data_dir / "claims.csv", CLAIM_COLUMNS):
        if c["ours"] == "capacity":
            values = [float(x) for x in re.findall(r"\d+\.\d+", c["paper"])]
            if len(values) == len(VARIANT_ORDER):
                return dict(zip(VARIANT_ORDER, values))
    raise StudyError("claims.csv: no capacity row with four bits-per-parameter values. Fix: restore it from git")


def table_capacity_headline(cells: list[Cell], data_dir: Path) -> str:
    head, paper = headline_cells(cells), paper_bits(data_dir)
    if "standard" not in head:
        raise StudyError("no standard capacity cell with three seeds. Fix: restore docs/data/capacity_w8_625k")
    std = mean_std([c.bits_per_trainable_param for c in head["standard"]])[0]
    rows = []
    for v, cs in head.items():
        x = [c.bits_per_trainable_param for c in cs]
        seeds = ", ".join(str(c.weights_seed) for c in cs)
        row = [VARIANT_NAMES[v], f"{cs[0].steps:,}", seeds, f"**{spread(x)}**", ", ".join(f"{y:.3f}" for y in x)]
        row += [f"{mean_std(x)[0] / std:.2f}", f"{paper[v]} ({paper[v] / paper['standard']:.2f})"]
        rows.append(
            row + [spread([c.bits for c in cs], 0), spread([c.acc for c in cs]), spread([c.loss_drop for c in cs])]
        )
    header = ["variant", "steps", "seeds", "bits / trainable param", "per seed", "fraction of standard"]
    header += ["paper (fraction)", "bits stored", "acc", "loss drop, last 20% of steps"]
    return _table(header, rows)


def seeds_cell(cs: list[Cell]) -> str:
    """'1.350 ± 0.033 (s0 1.326, s1 1.373)': the mean over seeds and each seed's value."""
    if not cs:
        return ""
    x = [c.bits_per_trainable_param for c in cs]
    each = ", ".join(f"s{c.weights_seed} {c.bits_per_trainable_param:.3f}" for c in cs)
    return f"{spread(x)} ({each})" if len(cs) > 1 else f"{x[0]:.3f} (s{cs[0].weights_seed})"


def table_capacity_lengths(cells: list[Cell], _: Path) -> str:
    runs = _recipe_runs(cells)
    lengths = sorted({c.steps for c in runs})
    rows = [
        [VARIANT_NAMES[v]] + [seeds_cell(_by(runs, v, n)) for n in lengths]
        for v in VARIANT_ORDER
        if any(c.variant == v for c in runs)
    ]
    return _table(["variant"] + [f"{n:,} steps" for n in lengths], rows)


def table_capacity_floor(cells: list[Cell], _: Path) -> str:
    floor0 = [c for c in cells if (c.lr, c.min_lr) == (RECIPE_RATES[0], 0.0)]
    lengths = sorted({c.steps for c in floor0})
    control = [c for c in _recipe_runs(cells) if c.steps in lengths and c.study.endswith("min_lr1e-3")]
    columns = [(n, floor0, f"{n:,} steps, floor 0") for n in lengths]
    columns += [(n, control, f"{n:,} steps, floor 1e-3 (control)") for n in sorted({c.steps for c in control})]
    rows = [
        [VARIANT_NAMES[v]] + [seeds_cell(_by(group, v, n)) for n, group, _name in columns]
        for v in VARIANT_ORDER
        if any(c.variant == v for c in floor0)
    ]
    return _table(["variant"] + [name for _n, _g, name in columns], rows)


def table_capacity_mixit_draws(cells: list[Cell], _: Path) -> str:
    lengths = sorted({c.steps for c in cells if c.variant == "mixit" and c.weights_seed != c.matrices_seed})
    if not lengths:
        raise StudyError("no MixiT cell with swapped seeds. Fix: restore docs/data/capacity_w8_625k_mixit_swap")
    n = lengths[-1]
    draws = [c for c in cells if c.variant == "mixit" and c.steps == n and (c.lr, c.min_lr) == RECIPE_RATES]
    draws.sort(key=lambda c: (c.weights_seed != c.matrices_seed, c.weights_seed, c.matrices_seed))
    rows = []
    for c in draws:
        draw = "own seed" if c.weights_seed == c.matrices_seed else "swapped halves"
        row = [draw, str(c.weights_seed), str(c.matrices_seed), f"{c.bits_per_trainable_param:.3f}"]
        rows.append(row + [f"{c.bits:,.0f} ({c.acc:.3f})", f"{c.loss_drop:.3f}"])
    own = [c.bits_per_trainable_param for c in draws if c.weights_seed == c.matrices_seed]
    every = [c.bits_per_trainable_param for c in draws]
    rows.append([f"**{len(own)} seeds, mean ± std**", "", "", f"**{spread(own)}**", "", ""])
    rows.append([f"all {len(every)} draws", "", "", spread(every), "", ""])
    header = [f"MixiT draw, {n:,} steps", "weights and data order of seed", "matrices of seed"]
    header += ["bits / trainable param", "bits (acc)", "loss drop, last 20%"]
    return _table(header, rows)


def table_capacity_frozen_mlp_rate(cells: list[Cell], _: Path) -> str:
    fm = [c for c in cells if c.variant == "frozen_mlp" and c.weights_seed == c.matrices_seed]
    rates = sorted({(c.lr, c.min_lr) for c in fm}, reverse=True)
    steps = max(c.steps for c in fm)
    header = [f"frozen-MLP, {steps:,} steps"] + [f"lr {lr:g} to {lo:g}" for lr, lo in rates]
    at = {rate: [c for c in fm if (c.lr, c.min_lr) == rate and c.steps == steps] for rate in rates}
    rows = []
    for s in sorted({c.weights_seed for c in fm if c.steps == steps}):
        cs = [next((c for c in at[rate] if c.weights_seed == s), None) for rate in rates]
        rows.append([f"seed {s}"] + [f"{c.bits_per_trainable_param:.3f} ({c.bits:,.0f} bits)" if c else "" for c in cs])
    rows.append(["mean ± std"] + [spread([c.bits_per_trainable_param for c in at[rate]]) for rate in rates])
    return _table(header, rows)


def table_capacity_commands(cells: list[Cell], _: Path) -> str:
    """One line per data file: what it holds and the command of its first cell (the others differ in
    --variants and --first-seed)."""
    rows = []
    for study in sorted({c.study for c in cells}, key=lambda s: (min(c.steps for c in cells if c.study == s), s)):
        cs = [c for c in cells if c.study == study]
        variants = [v for v in VARIANT_ORDER if any(c.variant == v for c in cs)]
        rows.append(
            [
                f"[{study}](../data/{study}/capacity.json)",
                str(len(cs)),
                ", ".join(VARIANT_NAMES[v] for v in variants),
                f"`{cs[0].command}`",
            ]
        )
    return _table(["rows", "cells", "variants", "the command of its first cell"], rows, right_from=9)


# ---- the summary ------------------------------------------------------------------------------------
def ours_capacity(cells: list[Cell]) -> str:
    head = headline_cells(cells)
    std = mean_std([c.bits_per_trainable_param for c in head["standard"]])[0]
    values = [[c.bits_per_trainable_param for c in cs] for cs in head.values()]
    seeds = "/".join(str(len(x)) for x in values)
    steps = "/".join(f"{cs[0].steps // 1000:,}k" for cs in head.values())
    fractions = " / ".join(f"{mean_std(x)[0] / std:.2f}" for x in values)
    return (
        f"{' / '.join(spread(x) for x in values)} bits per trainable param ({seeds} seeds, {steps} steps); "
        f"fractions of standard {fractions}; 2 layers, width {head['standard'][0].width}"
    )


def ours_retrieval(data_dir: Path) -> str:
    """Per (pairs, values), each main arm's held-out accuracy at its rate with the most seeds (then the best
    mean), with how many of its seeds trained where some did not (the controls are on the page)."""
    rows = [r for r in read_rows(data_dir / "retrieval" / "runs.jsonl") if "@" not in retrieval.arm_of(r)]
    if not rows:
        return "—"
    best: dict[tuple[int, int, int, str], list[dict]] = {}

    def setting(r: dict) -> tuple[int, int, int, str]:
        return r["task_args"]["n_pairs"], r["task_args"]["n_values"], r["steps"], r["variant"]

    def score(rs: list[dict]) -> tuple[int, float]:
        return len(rs), mean_std([r["acc"] or 0.0 for r in rs])[0]

    for key in sorted({(*setting(r), r["lr"]) for r in rows}):  # ties: the lower rate
        rs = [r for r in rows if (*setting(r), r["lr"]) == key]
        if key[:4] not in best or score(rs) > score(best[key[:4]]):
            best[key[:4]] = rs
    parts = []
    for pairs, values, steps in sorted({k[:3] for k in best}):
        cells = []
        for v in VARIANT_ORDER:
            rs = [r for r in best.get((pairs, values, steps, v), []) if r["acc"] is not None]
            if len(rs) > 1:
                m, s = mean_std([100 * r["acc"] for r in rs])
                trained = sum(not retrieval.did_not_train(r) for r in rs)
                note = "" if trained == len(rs) else f", {trained} of them trained"
                cells.append(f"{VARIANT_NAMES[v]} {m:.1f} ± {s:.1f} % ({len(rs)} seeds{note})")
        if cells:
            g = 100 * retrieval.mode_guess_exact(pairs, values)
            parts.append(
                f"{pairs} pairs, {values} values, {steps} steps: " + ", ".join(cells) + f"; in-context guess {g:.1f} %"
            )
    return "; ".join(parts)


def ours_lm(data_dir: Path) -> str:
    """The scaling study's paired gaps to standard (validation loss on the docs corpus, same budget, width,
    seed and data order) where a cell has >= 3 seeds: their range per variant, with the widths and budgets."""
    rows = read_rows(data_dir / "scaling" / "isoflop_runs.jsonl")
    gaps = [g for g in paired_gaps(rows, "final_val_loss", np.random.default_rng(0), 1000) if g["seeds"] >= 3]
    if not gaps:
        return "—"
    sizes = sorted({g["size"] for g in gaps}, key=lambda w: int(w[1:]))
    budgets = sorted({g["budget"] for g in gaps})
    params = sorted({r["non_embedding_params"] for r in rows if r["size"] in sizes})
    cells = []
    for v in ("frozen_qk", "mixit"):
        gs = [g for g in gaps if g["variant"] == v]
        excluding = sum(g["interval"][0] > 0 or g["interval"][1] < 0 for g in gs)
        cells.append(
            f"{VARIANT_NAMES[v]} {min(g['gap'] for g in gs):+.2f} to {max(g['gap'] for g in gs):+.2f} nats "
            f"({excluding} of {len(gs)} intervals exclude 0)"
        )
    return (
        "validation loss minus standard's, same budget, width and seed, 3 seeds: " + ", ".join(cells)
        + f"; docs corpus, 4 layers, widths {sizes[0]}-{sizes[-1]} ({params[0] / 1e3:.0f}k-{params[-1] / 1e3:.0f}k "
        f"non-embedding parameters), {budgets[0]:.2g}-{budgets[-1]:.2g} FLOPs".replace("e+", "e")
    )  # fmt: skip


def ours_induction(data_dir: Path) -> str:
    """Per variant, the last evaluation's best-head induction and previous-token scores on held-out text,
    mean ± std over seeds."""
    rows = read_rows(data_dir / "induction" / "runs.jsonl")
    if not rows:
        return "not yet trained"
    parts = []
    for v in VARIANT_ORDER:
        rs = [r for r in rows if r["variant"] == v and r["evals"]]
        if not rs:
            continue
        ind = mean_std([r["evals"][-1]["probe/induction_score_text"] for r in rs])
        prev = mean_std([r["evals"][-1]["probe/prev_token_score_text"] for r in rs])
        fixed = " (its fixed map)" if v == "mixit" else ""
        parts.append(
            f"{VARIANT_NAMES[v]} induction score {ind[0]:.3f} ± {ind[1]:.3f}, previous-token score "
            f"{prev[0]:.2f} ± {prev[1]:.2f}{fixed} ({len(rs)} seeds)"
        )
    layers = sorted({r["layers"] for r in rows})
    steps = sorted({r["steps"] for r in rows})
    return "; ".join(parts) + f"; {'/'.join(map(str, layers))} layers, step {'/'.join(map(str, steps))}"


def ours_arithmetic(data_dir: Path) -> str:
    """Per digit count and layout, each main arm's held-out exact match and token accuracy (mean ± std over
    seeds, at the rate its page chooses) and how many seeds solved it (the control arms and the sweep are
    on its page)."""
    chosen = arithmetic.chosen_runs(read_rows(data_dir / "arithmetic" / "runs.jsonl"))
    if not chosen:
        return "—"
    parts = []
    for digits, layout in sorted({key[:2] for key in chosen}):
        cells = []
        for v in VARIANT_ORDER:
            rs = next(
                (rs for (d, lay, _, arm), rs in sorted(chosen.items()) if (d, lay, arm) == (digits, layout, v)), None
            )
            if rs:
                m, s = mean_std([100 * r["exact_match"] for r in rs])
                tok = mean_std([100 * r["acc"] for r in rs])
                solved = sum(r["step_solved"] is not None for r in rs)
                cells.append(
                    f"{VARIANT_NAMES[v]} {m:.1f} ± {s:.1f} % exact, {tok[0]:.1f} ± {tok[1]:.1f} % token accuracy "
                    f"({solved}/{len(rs)} seeds solve it)"
                )
        parts.append(f"{digits} digits, {layout} layout: " + ", ".join(cells))
    return "; ".join(parts)


# the GPU run whose benchmark logs measure the speed claim (docs/PERFORMANCE.md, GPU, run 3), and its tables:
# (log under that run, what it timed)
GPU_SPEED_RUN = "gpu/2026-11-28_h200"
GPU_SPEED_TABLES = (
    ("call1/logs/bench_T2048.out", "T 2048 eager"),
    ("call2/logs/bench_compiled_T2048.out", "T 2048 compiled"),
    ("call1/logs/bench_T8192.out", "T 8192 eager"),
)


def bench_tokens_per_s(path: Path) -> dict[str, int]:
    """The tok/s column of benchmarks/bench_model.py's table: model -> tokens a second."""
    if not path.is_file():
        raise StudyError(f"{path}: the benchmark log is missing. Fix: restore it from git")
    out = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[0] in VARIANT_ORDER and fields[1].isdigit():
            out[fields[0]] = int(fields[1])
    return out


def ours_speed(data_dir: Path) -> str:
    """Each variant's tokens a second against standard's, from one GPU run's benchmark tables."""
    parts = []
    for log, label in GPU_SPEED_TABLES:
        tps = bench_tokens_per_s(data_dir / GPU_SPEED_RUN / log)
        if "standard" not in tps:
            raise StudyError(f"{data_dir / GPU_SPEED_RUN / log}: no standard row. Fix: restore it from git")
        cells = [
            f"{VARIANT_NAMES[v]} {100 * (tps[v] / tps['standard'] - 1):+.1f} %"
            for v in ("frozen_qk", "mixit")
            if v in tps
        ]
        parts.append(f"{label}: " + ", ".join(cells))
    return "preset 1b on one H200, bf16, tokens a second against standard's: " + "; ".join(parts)


OURS: dict[str, Callable[[list[Cell], Path], str]] = {
    "arithmetic": lambda _, data_dir: ours_arithmetic(data_dir),
    "speed": lambda _, data_dir: ours_speed(data_dir),
    "induction": lambda _, data_dir: ours_induction(data_dir),
    "capacity": lambda cells, _: ours_capacity(cells),
    "retrieval": lambda _, data_dir: ours_retrieval(data_dir),
    "lm": lambda _, data_dir: ours_lm(data_dir),
}


def table_summary(cells: list[Cell], data_dir: Path) -> str:
    rows = []
    for c in read_csv(data_dir / "claims.csv", CLAIM_COLUMNS):
        if c["ours"] and c["ours"] not in OURS:
            raise StudyError(f"claims.csv: ours={c['ours']!r} is not one of {sorted(OURS)}. Fix: name a row set")
        if not c["verdict"].startswith(VERDICTS):
            raise StudyError(f"claims.csv: verdict {c['verdict']!r} is not one of {VERDICTS}. Fix: use one of them")
        if not c["ours"] and not c["verdict"].startswith("not measured"):
            raise StudyError(f"claims.csv: {c['claim']!r} has a verdict but no rows. Fix: 'not measured' or rows")
        ours = OURS[c["ours"]](cells, data_dir) if c["ours"] else "—"
        verdict = f"**{c['verdict']}**" + (f"; command: `{c['command']}`" if c["command"] else "")
        rows.append([c["claim"], c["paper"], c["where"], ours, verdict, c["page"]])
    return _table(["claim", "paper", "where in the paper", "ours (mean ± std)", "verdict", "section"], rows, 9)


def table_rows_lost(_: list[Cell], data_dir: Path) -> str:
    rows = [
        [r["result"], r["page"], f"`{r['command']}`"]
        for r in read_csv(data_dir / "rows_lost.csv", ("result", "page", "command"))
    ]
    return _table(["result (not measured: rows lost)", "page", "the command that re-measures it"], rows, 9)


TABLES: dict[str, Callable[[list[Cell], Path], str]] = {
    "summary": table_summary,
    "rows-lost": table_rows_lost,
    "capacity-headline": table_capacity_headline,
    "capacity-lengths": table_capacity_lengths,
    "capacity-floor": table_capacity_floor,
    "capacity-mixit-draws": table_capacity_mixit_draws,
    "capacity-frozen-mlp-rate": table_capacity_frozen_mlp_rate,
    "capacity-rows": table_capacity_commands,
    "retrieval": lambda _, data_dir: retrieval.render(read_rows(data_dir / "retrieval" / "runs.jsonl")) + "\n",
    "arithmetic": lambda _, data_dir: arithmetic.render(read_rows(data_dir / "arithmetic" / "runs.jsonl")) + "\n",
    "arithmetic-ladder": lambda _, data_dir: (
        arithmetic.render_ladder(read_rows(data_dir / "arithmetic" / "runs.jsonl")) + "\n"
    ),
    "parity": lambda _, data_dir: (
        parity.render(read_rows(data_dir / "parity" / "runs.jsonl"), read_rows(data_dir / "parity" / "reference.jsonl"))
        + "\n"
    ),
    "induction": lambda _, data_dir: induction.render_rows(read_rows(data_dir / "induction" / "runs.jsonl")),
    "induction-checkpoints": lambda _, data_dir: (
        induction_checkpoints.render(read_rows(data_dir / "induction" / "scaling_checkpoints.jsonl")) + "\n"
    ),
    "retrieval-baselines": lambda _, data_dir: retrieval.baselines_table(RETRIEVAL_BASELINES) + "\n",
}


# ---- pages ------------------------------------------------------------------------------------------
def render_page(text: str, tables: dict[str, str], name: str) -> tuple[str, list[str]]:
    """The page with every marked table replaced by its rendering, and the tables that changed."""
    changed = []

    def one(m: re.Match) -> str:
        if m.group(1) not in tables:
            raise StudyError(f"{name}: unknown table {m.group(1)!r}. Fix: use one of {', '.join(TABLES)}")
        if m.group(2) != tables[m.group(1)]:
            changed.append(m.group(1))
        return f"<!-- table:{m.group(1)} -->\n{tables[m.group(1)]}<!-- /table:{m.group(1)} -->"

    out = MARKER.sub(one, text)
    if any(line.startswith("|") for line in MARKER.sub("", out).splitlines()):
        raise StudyError(f"{name}: a table outside <!-- table:NAME --> markers. Fix: render it from rows")
    return out, changed


def render(root: Path, check: bool) -> list[str]:
    """Render every page under root/docs; with `check`, write nothing. The tables that differed."""
    docs, data = root / "docs", root / "docs" / "data"
    cells = read_capacity(data, root)
    tables = {name: make(cells, data) for name, make in TABLES.items()}
    differ, used = [], set()
    for page in [docs / "RESULTS.md", *sorted((docs / "results").glob("*.md"))]:
        text = page.read_text()
        used |= {m.group(1) for m in MARKER.finditer(text)}
        out, changed = render_page(text, tables, str(page.relative_to(root)))
        differ += [f"{page.relative_to(root)}: {t}" for t in changed]
        if not check and out != text:
            page.write_text(out)
    if set(TABLES) - used:
        raise StudyError(f"no page shows the table(s) {', '.join(sorted(set(TABLES) - used))}. Fix: add their markers")
    return differ


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m studies.results_page", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["render"])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page disagrees with its rows")
    ap.add_argument("--root", type=Path, default=REPO_ROOT, help="the repository whose docs/ to render")
    a = ap.parse_args(argv)

    def body() -> int:
        differ = render(a.root, a.check)
        for d in differ:
            print(("differs from its rows: " if a.check else "rendered: ") + d)
        if a.check and differ:
            print_error("the pages disagree with their rows in docs/data", "python -m studies.results_page render")
            return 1
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
