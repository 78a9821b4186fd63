"""Training loss of several runs against step, from their metrics.jsonl: binned, tabled by tenths, plotted.

    python -m studies.loss_curves outputs/capacity625k/mixit_w8=625k outputs/capacity1562k/mixit_w8=1.5625M \
        --fraction --out docs/figures/loss.png

A long run logs thousands of noisy per-batch losses, and whether it has flattened is read from means over
stretches of steps, not from its last line. Each RUN is a run directory the trainer wrote (a `=LABEL` suffix
names its line). Prints each run's mean loss over each tenth of its logged steps and how much it fell over the
last fifth (`studies.capacity.loss_drop` on the logged records; a capacity row's own column also counts every
step its last process trained, so the two differ by the noise of the sparser sample); the figure has one line
per run, the mean over `--points` equal stretches of steps, against step or, with `--fraction`, against the
fraction of the run's own `train.max_steps` (runs of different lengths then line up where their learning-rate
schedules do). A run still under way is read as far as it has logged.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.cli import run_cli
from common.errors import StudyError
from eval.report import markdown_table, new_figure, save_figure
from pretrain.run_dir import read_config

from .capacity import loss_drop, training_losses
from .shared import label_axes, study_parser


def parse_run(arg: str) -> tuple[Path, str]:
    """'DIR=LABEL' -> (DIR, LABEL); a bare DIR is labelled by its path."""
    path, sep, label = arg.rpartition("=")
    return (Path(path), label) if sep and Path(path).is_dir() else (Path(arg), arg)


def read_run(run_dir: Path) -> tuple[list[tuple[int, float]], int | None]:
    """The run's (step, loss) records and its scheduled train.max_steps (None when config.yaml lacks it)."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise StudyError(f"{run_dir} has no metrics.jsonl. Fix: pass a run directory the trainer wrote")
    points = training_losses(run_dir)
    if not points:
        raise StudyError(f"{run_dir}/metrics.jsonl has no training loss yet. Fix: wait for its first logged step")
    cfg = read_config(run_dir)
    max_steps = (cfg.get("train") or {}).get("max_steps") if cfg else None
    return points, int(max_steps) if max_steps else None


def range_means(points: list[tuple[int, float]], n: int) -> dict[int, float]:
    """Range index i -> mean loss over the steps (i * last / n, (i + 1) * last / n], `last` the last logged
    step; ranges with no record are left out (a run resumed from a checkpoint logs on from there)."""
    last = points[-1][0]
    losses: dict[int, list[float]] = {}
    for step, loss in points:
        losses.setdefault(min(n - 1, max(0, -(-step * n // last) - 1)), []).append(loss)
    return {i: sum(xs) / len(xs) for i, xs in sorted(losses.items())}


def binned(points: list[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    """`range_means` as (range end step, mean loss), the points a curve is drawn through."""
    last = points[-1][0]
    return [(round((i + 1) * last / n), mean) for i, mean in range_means(points, n).items()]


def table(runs: list[tuple[str, list[tuple[int, float]], int | None]]) -> str:
    header = ["run", "steps logged / scheduled", *(f"tenth {i}" for i in range(1, 11)), "drop over the last fifth"]
    rows = []
    for label, points, max_steps in runs:
        tenths = range_means(points, 10)
        cells = [f"{tenths[i]:.3f}" if i in tenths else "-" for i in range(10)]
        sched = f"{max_steps:,}" if max_steps else "?"
        rows.append([label, f"{points[-1][0]:,} / {sched}", *cells, f"{loss_drop(dict(points)):.3f}"])
    return markdown_table(header, rows, right_from=1)


def plot(runs, out: Path, points: int, fraction: bool) -> Path:
    fig, ax = new_figure(figsize=(9, 5))
    for label, pts, max_steps in runs:
        xs, ys = zip(*binned(pts, points))
        if fraction:
            xs = [x / (max_steps or pts[-1][0]) for x in xs]
        ax.plot(xs, ys, lw=1.2, label=label)
    xlabel = "fraction of the run's train.max_steps" if fraction else "step"
    label_axes(ax, xlabel, f"training loss (mean over 1/{points} of the logged steps)")
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.loss_curves", __doc__)
    ap.add_argument("runs", nargs="+", help="run directories, each optionally DIR=LABEL")
    ap.add_argument("--points", type=int, default=50, help="stretches of steps averaged into one point")
    ap.add_argument("--fraction", action="store_true", help="x axis: fraction of each run's train.max_steps")
    ap.add_argument("--out", type=Path, default=Path("loss_curves.png"), help="where the figure goes")
    a = ap.parse_args(argv)
    if a.points < 1:
        ap.error(f"--points {a.points} is not a positive count")

    def body() -> None:
        runs = []
        for arg in a.runs:
            path, label = parse_run(arg)
            runs.append((label, *read_run(path)))
        print(table(runs))
        print(f"figure: {plot(runs, a.out, a.points, a.fraction)}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
