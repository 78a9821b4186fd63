"""Bits per trainable parameter against training length, from several capacity studies.

    python -m studies.capacity_trend outputs/capacity16k outputs/capacity40k outputs/capacity100k \
        --width 8 --out docs/figures/capacity_trend.png

A capacity that has converged stops growing with more steps; one that has not keeps rising. Each
DIR is one `studies.capacity` out-dir (its capacity.json, the same recipe and data, another
`train.max_steps`); every row of the given width is placed at its training length. Prints one row
per variant (mean ± std over seeds at each length, and the gain per doubling of the steps between
the last two lengths), one of each variant's mean as a fraction of standard's at the same length
with the paper's values beside them, and one of the final training losses. The figure: left, bits
per trainable parameter against steps (log axis; mean and every seed, the paper's value dashed);
right, the fraction of standard's.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from common.cli import run_cli
from common.errors import StudyError
from eval.report import markdown_table, new_figure, save_figure

from .capacity import DEFAULT_VARIANTS, PAPER_BITS_PER_PARAM, finished_cells
from .shared import study_parser
from .spread import Spread

KEY = "bits_per_trainable_param"


def read_rows(dirs: list[Path], width: int) -> list[dict[str, Any]]:
    """Every finished cell of `width` in the given study directories: each cell's study_result.json
    (so a study still under way shows what it has finished), or the study's capacity.json."""
    rows = []
    for d in dirs:
        cells = finished_cells(d)
        path = Path(d) / "capacity.json"
        if not cells and not path.is_file():
            raise StudyError(f"{path} does not exist. Fix: pass directories written by python -m studies.capacity")
        try:
            found = [r for r in (cells or json.loads(path.read_text())) if r.get("width") == width]
        except (ValueError, AttributeError):
            raise StudyError(f"{path} is not a capacity study's result list. Fix: run that study again") from None
        if not found:
            raise StudyError(f"{d} has no finished cell of width {width}. Fix: --width one of the widths it ran")
        rows += found
    return rows


def by_length(rows: list[dict[str, Any]], key: str = KEY) -> dict[str, dict[int, Spread]]:
    """variant -> training steps -> `key` (default: bits per trainable parameter) over its seeds."""
    cells: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        if key in r:
            cells.setdefault(r["variant"], {}).setdefault(int(r["steps"]), []).append(float(r[key]))
    return {v: {s: Spread.of(xs) for s, xs in sorted(per.items())} for v, per in cells.items()}


def gain_per_doubling(per: dict[int, Spread]) -> float | None:
    """Bits per trainable parameter gained per doubling of the steps between the two longest runs."""
    if len(per) < 2:
        return None
    (s0, a), (s1, b) = list(per.items())[-2:]
    return (b.mean - a.mean) / math.log2(s1 / s0)


def table(trend: dict[str, dict[int, Spread]]) -> str:
    lengths = sorted({s for per in trend.values() for s in per})
    head = [f"{s:,} steps" for s in lengths]
    rows = []
    for v in sorted(trend, key=_order):
        per, g = trend[v], gain_per_doubling(trend[v])
        cells = [f"{per[s].format()} ({len(per[s].values)})" if s in per else "-" for s in lengths]
        rows.append([v, *cells, "-" if g is None else f"{g:+.3f}", PAPER_BITS_PER_PARAM.get(v, "-")])
    out = markdown_table(["variant", *head, "gain per doubling (last two)", "paper"], rows, right_from=1)
    if "standard" in trend:
        std, rows = trend["standard"], []
        for v in sorted(trend, key=_order):
            cells = [f"{trend[v][s].mean / std[s].mean:.2f}" if s in trend[v] and s in std else "-" for s in lengths]
            paper = PAPER_BITS_PER_PARAM.get(v)
            rows.append([v, *cells, f"{paper / PAPER_BITS_PER_PARAM['standard']:.2f}" if paper else "-"])
        out += "\n\n" + markdown_table(["fraction of standard", *head, "paper"], rows, right_from=1)
    return out


def loss_table(losses: dict[str, dict[int, Spread]]) -> str:
    """The final training loss per variant and length: where more steps no longer lower it, the cell is
    as trained as this schedule makes it."""
    lengths = sorted({s for per in losses.values() for s in per})
    rows = [
        [v, *(losses[v][s].format() if s in losses[v] else "-" for s in lengths)] for v in sorted(losses, key=_order)
    ]
    return markdown_table(["final training loss", *(f"{s:,} steps" for s in lengths)], rows, right_from=1)


def plot(trend: dict[str, dict[int, Spread]], out: Path, width: int) -> Path:
    fig, (left, right) = new_figure(1, 2, figsize=(13, 5))
    std = trend.get("standard", {})
    for v in sorted(trend, key=_order):
        per, color = trend[v], f"C{_order(v)}"
        steps = list(per)
        left.plot(steps, [per[s].mean for s in steps], "o-", color=color, label=v)
        for s in steps:
            left.plot([s] * len(per[s].values), per[s].values, ".", color=color, alpha=0.6)
        if v in PAPER_BITS_PER_PARAM:
            left.axhline(PAPER_BITS_PER_PARAM[v], color=color, ls="--", lw=0.8, alpha=0.7)
            right.axhline(PAPER_BITS_PER_PARAM[v] / PAPER_BITS_PER_PARAM["standard"], color=color, ls="--", lw=0.8)
        shared = [s for s in steps if s in std]
        if shared:
            right.plot(shared, [per[s].mean / std[s].mean for s in shared], "o-", color=color, label=v)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("training steps")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    left.set_ylabel("bits / trainable parameter")
    left.set_title(f"width {width}: bits per trainable parameter vs steps (dashed: the paper's)", fontsize=10)
    right.set_ylabel("fraction of standard's bits / trainable parameter")
    right.set_title("each variant relative to standard (dashed: the paper's ratios)", fontsize=10)
    return save_figure(fig, out)


def _order(variant: str) -> int:
    return DEFAULT_VARIANTS.index(variant) if variant in DEFAULT_VARIANTS else len(DEFAULT_VARIANTS)


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.capacity_trend", __doc__)
    ap.add_argument("dirs", nargs="+", type=Path, help="studies.capacity out-dirs (one training length each)")
    ap.add_argument("--width", type=int, default=8, help="the width to follow across the studies")
    ap.add_argument("--out", type=Path, default=Path("capacity_trend.png"), help="where the figure goes")
    a = ap.parse_args(argv)

    def body() -> None:
        rows = read_rows(a.dirs, a.width)
        trend = by_length(rows)
        print(table(trend))
        print()
        print(loss_table(by_length(rows, "final_loss")))
        print(f"figure: {plot(trend, a.out, a.width)}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
