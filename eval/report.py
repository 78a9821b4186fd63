"""Reports over many evaluated checkpoints: flat metric names, markdown/CSV tables,
TensorBoard scalars against the training step, and PNG plots (one line per run/variant).
`markdown_table`, `new_figure` and `save_figure` are the table and figure helpers of every
report and study."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

INFO_COLS = ("run", "variant", "step", "tokens_seen")


def flatten(tasks: dict[str, Any]) -> dict[str, float]:
    """{"induction": {"acc": .9, "by_length": {"16": {"acc": 1}}}} -> {"induction/acc": .9,
    "induction/by_length/16/acc": 1}. Lists (per-head grids) and non-numbers are skipped."""
    out: dict[str, float] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
            out[prefix] = float(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)

    for task, res in tasks.items():
        walk(task, res)
    return out


def rows_from_results(results: Iterable[dict[str, Any]], run: str | None = None) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        ck = r.get("checkpoint", {})
        row = {
            "run": run or r.get("run") or Path(ck.get("path", "?")).name,
            "variant": ck.get("variant"),
            "step": ck.get("step"),
            "tokens_seen": ck.get("tokens_seen"),
        }
        row.update(r.get("metrics") or flatten(r.get("tasks", {})))
        rows.append(row)
    return sorted(rows, key=lambda x: (str(x["run"]), x["step"] if x["step"] is not None else -1))


def headline(metric: str) -> bool:
    """Metrics worth a table column / plot (the per-length details stay in the JSON)."""
    return "/by_" not in metric and not metric.endswith(
        ("/tokens", "/windows", "/window", "/stride", "/samples", "sample_len", "/chance_acc")
    )


def markdown_table(
    header: list[str], rows: Iterable[Iterable[Any]], right_from: int | None = None, align: str | None = None
) -> str:
    """A markdown table, one line per row (no final newline). Columns from `right_from` on are
    right-aligned (numbers), the rest left-aligned; or `align` gives each column, `l` or `r`."""
    if align is None:
        align = "".join("l" if right_from is None or i < right_from else "r" for i in range(len(header)))
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one of l, r per column of {header}")
    rule = ["---:" if a == "r" else "---" for a in align]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in [header, rule, *rows])


def new_figure(*args: Any, **kwargs: Any):
    """`plt.subplots(...)` on the file-only Agg backend. matplotlib is slow to import, so it is imported
    here, when a plot is drawn, and nowhere else."""
    import matplotlib  # deferred: heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: heavy

    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: str | Path, dpi: int = 90) -> Path:
    """Lay `fig` out, write it to `path` (PNG; its directory made) and free it."""
    import matplotlib.pyplot as plt  # deferred: heavy (imported already by new_figure)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def checkpoint_table(result: dict[str, Any]) -> str:
    """One checkpoint's headline metrics as a markdown table, a row each, under a line naming it."""
    ck = result.get("checkpoint", {})
    rows = [(k, _fmt(v)) for k, v in result.get("metrics", {}).items() if headline(k)]
    return f"{ck.get('path')} (step {ck.get('step')}, {ck.get('variant')})\n" + markdown_table(
        ["metric", "value"], rows, right_from=1
    )


def write_table(rows: list[dict[str, Any]], md_path: str | Path, csv_path: str | Path) -> None:
    """The headline metrics as a markdown table, every metric as CSV."""
    cols = list(INFO_COLS) + sorted({k for r in rows for k in r if k not in INFO_COLS and headline(k)})
    Path(md_path).parent.mkdir(parents=True, exist_ok=True)
    Path(md_path).write_text(markdown_table(cols, ([_fmt(r.get(c)) for c in cols] for r in rows)) + "\n")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, list(INFO_COLS) + sorted({k for r in rows for k in r if k not in INFO_COLS}))
        w.writeheader()
        w.writerows(rows)


def write_tensorboard(rows: list[dict[str, Any]], logdir: str | Path) -> None:
    """One scalar per metric, x = the checkpoint's training step (tag prefix `eval/`)."""
    from torch.utils.tensorboard import SummaryWriter  # deferred: heavy

    w = SummaryWriter(log_dir=str(logdir))
    try:
        for r in rows:
            if r.get("step") is None:
                continue
            for k, v in r.items():
                if k not in INFO_COLS and isinstance(v, (int, float)):
                    w.add_scalar(f"eval/{k}", v, global_step=int(r["step"]))
    finally:
        w.close()


def plot_metrics(rows: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One PNG per headline metric vs step; one line per run, labelled by variant (and run when ambiguous)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = sorted({k for r in rows for k in r if k not in INFO_COLS and headline(k)})
    runs: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("step") is not None:
            runs.setdefault(str(r["run"]), []).append(r)
    variants = [rs[0].get("variant") for rs in runs.values()]
    paths = []
    for m in metrics:
        series = []
        for (run, rs), variant in zip(runs.items(), variants):
            pts = sorted((r["step"], r[m]) for r in rs if isinstance(r.get(m), (int, float)))
            if pts:
                series.append((variant if variants.count(variant) == 1 else f"{variant} ({run})", pts))
        if not series:
            continue
        fig, ax = new_figure(figsize=(5, 3.5))
        for label, pts in series:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set(xlabel="training step", ylabel=m)
        ax.set_title(m, fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        safe = re.sub(r"[^A-Za-z0-9_.@-]+", "_", m).strip("_")
        paths.append(save_figure(fig, out_dir / f"{safe}.png", dpi=80))
    return paths


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # an empty line, or a torn last line from an interrupted run
    return out
