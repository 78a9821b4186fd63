"""Memorization capacity: bits stored per parameter by 2-layer models of each variant.

    python -m studies.capacity --recipe recipes/capacity_memorization.yaml --widths 16,32,64 --out-dir runs/capacity
    python -m studies.capacity --widths 8,16 --seeds 2 --out-dir runs/capacity   # every cell twice: mean ± std
    python -m studies.capacity --widths 8 --seeds 3 --parallel 2 --out-dir runs/capacity   # two cells at a time
    python -m studies.capacity --widths 8 --first-seed 1 --out-dir runs/capacity   # seed 1 only, as its own job
    python -m studies.capacity --gather --out-dir runs/capacity         # the table over every finished cell
    python -m studies.capacity --smoke --out-dir /tmp/capacity          # smallest configuration, seconds

For every (variant, width) the recipe is trained with the DeepSpeed trainer (world size 1) on
data_pipeline.synthetic's `memorization` task (random labels for all pairs (x1, x2)); the final
checkpoint is scored on every pair, and the stored information is the task's capacity_bits(acc) (a
C-ary symmetric channel: n_pairs * (log2 C - H2(a) - (1-a) log2(C-1))). Reported: bits, bits per
trainable parameter (the paper's measure), bits per parameter overall, and `data_bits`
(n_pairs * log2 C), so saturated rows (acc ~ 1: the data, not the model, is the limit) stand out.
`loss_drop_last_20pct` is how much the training loss fell over the last fifth of the steps, the
schedule's annealing included; whether a capacity has converged is read across training lengths
(studies.capacity_trend).

Seed i re-initialises the model (the recipe's seed + i; MixiT: matrices of seed i) on the same labels,
in OUT/<variant>_w<width>_s<i> (seed 0: <variant>_w<width>); rows show mean ± std over the seeds. A
study's seeds can run as separate jobs into one OUT (`--first-seed`), and `--gather` writes the table
and figure over every finished cell there. A finished cell (its study_result.json) is not trained
again; an unfinished one continues from its last checkpoint when the same command runs again, so a
long study can span many jobs; a cell directory that holds another command's run is refused by name.
`--parallel N` trains the cells in N one-thread processes, each a share of the variants: a tiny
model's step is mostly per-step overhead, so two processes on two cores train about twice as many
cells per hour as one.

Writes OUT/capacity.json, OUT/capacity.md (the table with the paper's numbers beside ours) and
OUT/capacity.png (every cell's training loss against step, and the bits per trainable parameter per
width beside the paper's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from checkpoint import load_for_eval
from common.cli import run_cli
from common.errors import StudyError
from data_pipeline.synthetic import get_task
from eval.report import markdown_table, new_figure, save_figure
from eval.synthetic_tasks import evaluate_task
from pretrain.config import load_recipe
from pretrain.metrics import read_metrics
from pretrain.run_dir import read_config
from pretrain.train import train

from .shared import label_axes, names, positive_ints, ran_to_end, seed_overrides, study_parser, without
from .spread import Spread

# Bits per trainable parameter, 2-layer models (Dong et al., "Attention Retrieves, MLP Memorizes").
PAPER_BITS_PER_PARAM = {"standard": 2.98, "frozen_qk": 2.25, "mixit": 2.18, "frozen_mlp": 1.13}
DEFAULT_VARIANTS = ("standard", "frozen_qk", "mixit", "frozen_mlp")
SMOKE = {
    "widths": (8,),
    "overrides": [
        "data.task_args={n1: 8, n2: 8, n_labels: 4}",
        "train.max_steps=20",
        "train.global_batch_sequences=64",
        "train.micro_batch_sequences=64",
    ],
}


def size_overrides(width: int, mlp_ratio: int = 3) -> list[str]:
    heads = 2 if width % 4 == 0 else 1
    return [
        f"model.hidden_size={width}",
        f"model.intermediate_size={mlp_ratio * width}",
        f"model.num_heads={heads}",
        "model.num_kv_heads=null",
    ]


def cell_dir(out_dir: Path, variant: str, width: int, seed_index: int) -> Path:
    return Path(out_dir) / (f"{variant}_w{width}" + (f"_s{seed_index}" if seed_index else ""))


def loss_drop(losses: dict[int, float], fraction: float = 0.2) -> float:
    """How much the training loss fell over the last `fraction` of the steps: the mean loss over the first
    5% of the run's steps in that stretch minus the mean over the last 5% (so one noisy step does not
    decide it). The windows are step ranges, so a curve logged densely only after a resume reads the same."""
    steps = sorted(losses)
    last = steps[-1]
    start = last * (1 - fraction)
    window = max(1.0, last / 20)
    head = [losses[s] for s in steps if start < s <= start + window] or [losses[min(s for s in steps if s > start)]]
    end = [losses[s] for s in steps if s > last - window]
    return sum(head) / len(head) - sum(end) / len(end)


def cell_overrides(recipe: str, overrides: list[str], variant: str, width: int, mlp_ratio: int, seed_index: int):
    """The recipe overrides that make one cell: the sweep's own, its size, its variant and its seed."""
    over = list(overrides) + size_overrides(width, mlp_ratio) + [f"model.variant={variant}"]
    if seed_index:  # seed 0 is the recipe's own
        over += seed_overrides(load_recipe(recipe, over).seed, seed_index)
    return over


def run_cell(
    recipe: str, variant: str, width: int, overrides: list[str], run_dir: Path, mlp_ratio: int = 3, seed_index: int = 0
) -> dict[str, Any]:
    """Train one cell (or continue it from its last checkpoint) and score its final checkpoint on every pair."""
    over = cell_overrides(recipe, overrides, variant, width, mlp_ratio, seed_index)
    cfg = load_recipe(recipe, over)
    t0 = time.time()
    res = ran_to_end(train(recipe, over, run_dir=run_dir, resume="auto"), run_dir)
    # the whole run's curve: the logged steps, and every step this process trained
    losses = {**dict(training_losses(run_dir)), **res.losses}
    model, info = load_for_eval(res.last_checkpoint)
    model.eval()
    args = {k: v for k, v in cfg.data.task_args.items() if k not in ("n_val", "seed")}
    task = get_task("memorization", seed=cfg.data.seed, **args)
    ev = evaluate_task(model, task, n=task.n_pairs, split="train", batch_size=4096, info=info, progress=False)
    # The parameters a model of this size really has: the LM head is used (it predicts the label).
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    bits = task.capacity_bits(ev["acc"])
    return {
        "variant": variant,
        "width": width,
        "layers": model.cfg.num_layers,
        "params_total": total,
        "params_trainable": trainable,
        "n_pairs": task.n_pairs,
        "n_labels": task.n_labels,
        "data_bits": task.n_pairs * math.log2(task.n_labels),
        "acc": ev["acc"],
        "bits": bits,
        "bits_per_trainable_param": bits / max(1, trainable),
        "bits_per_param": bits / max(1, total),
        "final_loss": losses[max(losses)],
        "loss_drop_last_20pct": loss_drop(losses),
        "steps": res.final_step,
        "seed_index": seed_index,
        "seconds": round(time.time() - t0, 1),  # this process's share when the cell was resumed
        "resumed_from": res.resumed_from.name if res.resumed_from else None,  # the checkpoint tag, if any
        "recipe": str(recipe),
        "overrides": over,
    }


def read_result(run_dir: Path) -> dict[str, Any] | None:
    """A finished cell's result (its study_result.json), or None for a cell not finished yet."""
    path = Path(run_dir) / "study_result.json"
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except ValueError:
        result = None
    if not isinstance(result, dict):
        raise StudyError(
            f"{path} is not a cell's result (JSON object). Fix: delete it and run again to score that cell afresh"
        )
    return result


def check_same_cell(result: dict[str, Any], recipe: str, overrides: list[str], run_dir: Path) -> None:
    """A finished cell is reused only for the command that made it (results written before cells
    recorded their command are taken as they are)."""
    if "overrides" not in result:
        return
    if result["recipe"] != str(recipe) or result["overrides"] != overrides:
        theirs, ours = set(result["overrides"]), set(overrides)
        diff = sorted(theirs ^ ours) or [f"recipe {result['recipe']} vs {recipe}"]
        raise StudyError(
            f"{run_dir} holds a cell finished by another command (differs in: {', '.join(diff[:6])}). "
            "Fix: another --out-dir, or the command that cell was made with"
        )


def check_cell(run_dir: Path, recipe: str, overrides: list[str]) -> None:
    """Before any cell trains: a finished cell must come from this command, and an unfinished one must
    be heading for the same number of steps (the trainer continues a run to more steps, which here would
    splice two learning-rate schedules into one cell)."""
    finished = read_result(run_dir)
    if finished is not None:
        check_same_cell(finished, recipe, overrides, run_dir)
        return
    stored = read_config(run_dir)
    if stored is None:
        return  # the trainer's own check of the run directory reports an unreadable one
    old = (stored.get("train") or {}).get("max_steps")
    new = load_recipe(recipe, overrides).train.max_steps
    if old is not None and old != new:
        raise StudyError(
            f"{run_dir} holds an unfinished cell of train.max_steps={old}; this command asks for {new}, which "
            f"would change its learning-rate schedule mid-run. Fix: another --out-dir, or train.max_steps={old} "
            "to finish it"
        )


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (variant, width), mean ± std over its seeds where there are several."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["variant"], r["width"]), []).append(r)
    seeds = max(len(rs) for rs in cells.values())
    header = ["variant", "width", "params (trainable / total)", "data bits", *(["seeds"] if seeds > 1 else [])]
    header += ["acc", "bits", "bits / trainable param", "bits / param", "loss drop, last 20% of steps"]
    header += ["max bits/trainable (over widths)", "paper bits/param"]
    out = []
    best: dict[str, float] = {}
    for (v, _), rs in cells.items():
        best[v] = max(best.get(v, 0.0), Spread.of([r["bits_per_trainable_param"] for r in rs]).mean)
    for (v, w), rs in cells.items():
        r0 = rs[0]
        paper = PAPER_BITS_PER_PARAM.get(v)

        def col(key: str, fmt: str, rs=rs) -> str:
            return Spread.of([r[key] for r in rs]).format(fmt)

        drop = col("loss_drop_last_20pct", "{:.3f}") if all("loss_drop_last_20pct" in r for r in rs) else "-"
        out.append(
            [v, w, f"{r0['params_trainable']:,} / {r0['params_total']:,}", f"{r0['data_bits']:,.0f}"]
            + ([len(rs)] if seeds > 1 else [])
            + [col("acc", "{:.3f}"), col("bits", "{:,.0f}"), col("bits_per_trainable_param", "{:.3f}")]
            + [col("bits_per_param", "{:.3f}"), drop, f"{best[v]:.3f}", paper if paper is not None else "-"]
        )
    return markdown_table(header, out)


def training_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, training loss) as the trainer logged it to the cell's metrics.jsonl."""
    rows = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []
    return [(int(r["step"]), float(r["loss"])) for r in rows if r.get("loss") is not None]


def plot(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    """Left: every cell's training loss against step (one color per variant, one line style per width).
    Right: bits per trainable parameter against width, mean and every seed, the paper's value dashed."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    widths = sorted({r["width"] for r in rows})
    color = {v: f"C{i}" for i, v in enumerate(DEFAULT_VARIANTS)}
    style = dict(zip(widths, ("-", "--", ":", "-.") * len(widths)))
    fig, (left, right) = new_figure(1, 2, figsize=(13, 5))
    labelled = set()
    for r in rows:
        pts = training_losses(cell_dir(out_dir, r["variant"], r["width"], r.get("seed_index", 0)))
        if pts:
            key = (r["variant"], r["width"])
            label = f"{r['variant']}, width {r['width']}" if key not in labelled else None
            left.plot(*zip(*pts), style[r["width"]], color=color.get(r["variant"], "k"), lw=1, alpha=0.7, label=label)
            labelled.add(key)
    label_axes(left, "step", "training loss (nats)", "training loss of every cell (one line per seed)")
    for v in variants:
        vs = [r for r in rows if r["variant"] == v]
        ws = sorted({r["width"] for r in vs})
        means = [Spread.of([r["bits_per_trainable_param"] for r in vs if r["width"] == w]).mean for w in ws]
        right.plot(ws, means, "o-", color=color.get(v, "k"), label=v)
        right.plot([r["width"] for r in vs], [r["bits_per_trainable_param"] for r in vs], ".", color=color.get(v, "k"))
        if v in PAPER_BITS_PER_PARAM:
            right.axhline(PAPER_BITS_PER_PARAM[v], color=color.get(v, "k"), ls="--", lw=0.8, alpha=0.7)
    right.set_xticks(widths)
    title = "bits stored per trainable parameter (dashed: the paper's)"
    label_axes(right, "width (hidden size)", "bits / trainable parameter", title)
    return save_figure(fig, Path(out_dir) / "capacity.png")


def run_sweep(
    recipe: str,
    variants,
    widths,
    overrides: list[str],
    out_dir: Path,
    mlp_ratio: int = 3,
    seeds: int = 1,
    first_seed: int = 0,
    report: bool = True,
) -> list[dict[str, Any]]:
    """Train (or read back) every cell, seeds outermost so that every variant has seed 0 first; with
    `report`, write capacity.json, capacity.md and capacity.png over all of them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(first_seed, first_seed + seeds):
        for w in widths:
            for v in variants:
                run_dir = cell_dir(out_dir, v, int(w), i)
                r = read_result(run_dir)
                if r is None:
                    r = run_cell(recipe, v, int(w), overrides, run_dir, mlp_ratio, i)
                    (run_dir / "study_result.json").write_text(json.dumps(r) + "\n")
                rows.append(r)
                print(
                    f"{v:>18} width {w:>4} seed {i}: acc {r['acc']:.3f}  bits {r['bits']:,.0f}  "
                    f"bits/trainable {r['bits_per_trainable_param']:.3f}  ({r['seconds']}s)"
                )
                if report:
                    (out_dir / "capacity.json").write_text(json.dumps(rows, indent=1) + "\n")
    if report:
        write_report(rows, out_dir, variants)
    return rows


def write_report(rows: list[dict[str, Any]], out_dir: Path, variants) -> None:
    """capacity.json, capacity.md and capacity.png over `rows`, by width, then `variants`' order, then seed."""
    rows.sort(key=lambda r: (r["width"], list(variants).index(r["variant"]), r.get("seed_index", 0)))
    (out_dir / "capacity.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out_dir / "capacity.md").write_text(table(rows) + "\n")
    plot(rows, out_dir)


def finished_cells(out_dir: Path) -> list[dict[str, Any]]:
    """The result of every finished cell in `out_dir` (a study still under way shows what it has finished)."""
    return [r for c in sorted(Path(out_dir).glob("*/study_result.json")) if (r := read_result(c.parent))]


def gather(out_dir: Path) -> list[dict[str, Any]]:
    """Every finished cell in `out_dir`, whichever commands and seeds made them (cells run as separate
    jobs), with the table and figure over all of them; trains nothing."""
    rows = finished_cells(out_dir)
    if not rows:
        raise StudyError(f"{out_dir} holds no finished cell. Fix: --out-dir a directory this study trained into")
    order = list(DEFAULT_VARIANTS) + sorted({r["variant"] for r in rows} - set(DEFAULT_VARIANTS))
    write_report(rows, Path(out_dir), order)
    return rows


def train_in_parallel(argv: list[str], variants: list[str], parallel: int, out_dir: Path) -> None:
    """Train the sweep's cells in `parallel` processes of this CLI (one thread each), process k taking
    variants k, k + parallel, ...; each writes its cells only (the caller writes the table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for k in range(min(parallel, len(variants))):
        share = ",".join(variants[k::parallel])
        log_path = out_dir / f"train_{k}.log"
        cmd = [sys.executable, "-m", "studies.capacity", *argv, "--variants", share, "--parallel", "1", "--cells-only"]
        with open(log_path, "a") as log:
            procs.append((share, log_path, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
    print(f"training in {len(procs)} processes; progress in {out_dir}/train_*.log", flush=True)
    failed = [f"{share} (exit {p.returncode}; see {log_path})" for share, log_path, p in procs if p.wait() != 0]
    if failed:
        raise StudyError(
            "training failed for " + "; ".join(failed) + ". Fix: read the log named, correct the cause and "
            "run the same command again (finished cells are kept)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.capacity", __doc__)
    ap.add_argument("--recipe", default="recipes/capacity_memorization.yaml")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument(
        "--widths", type=positive_ints, default=[16, 32, 64], help="hidden sizes (intermediate = mlp-ratio x width)"
    )
    ap.add_argument("--mlp-ratio", type=int, default=3)
    count = {"type": int, "metavar": "N", "default": 1}
    ap.add_argument(
        "--seeds", choices=range(1, 101), help="train every cell with this many seeds; rows show mean ± std", **count
    )
    ap.add_argument("--first-seed", type=int, choices=range(100), metavar="K", default=0, help="seed indices K..K+N-1")
    ap.add_argument(
        "--parallel", choices=range(1, 17), help="train the cells in N one-thread processes (2 on two cores)", **count
    )
    ap.add_argument(
        "--gather", action="store_true", help="train nothing: the table and figure over every finished cell in OUT"
    )
    ap.add_argument("--cells-only", action="store_true", help=argparse.SUPPRESS)  # a --parallel worker
    ap.add_argument("--smoke", action="store_true", help="the smallest configuration: width 8, 64 pairs, 20 steps")
    ap.add_argument("--out-dir", default="runs/capacity")
    ap.add_argument("overrides", nargs="*", help="recipe overrides section.key=value, applied to every cell")
    a = ap.parse_args(argv)
    widths, overrides = list(a.widths), list(a.overrides)
    if a.smoke:
        widths, overrides = list(SMOKE["widths"]), SMOKE["overrides"] + overrides
    variants, out = names(a.variants), Path(a.out_dir)

    def body() -> None:
        if a.gather:
            print(table(gather(out)))
            return
        for w in widths:  # every cell's recipe and run directory is checked before any trains
            for v in variants:
                for i in range(a.first_seed, a.first_seed + a.seeds):
                    over = cell_overrides(a.recipe, overrides, v, w, a.mlp_ratio, i)
                    load_recipe(a.recipe, over)
                    check_cell(cell_dir(out, v, w, i), a.recipe, over)
        t0 = time.time()
        if a.parallel > 1:
            worker_argv = without(argv if argv is not None else sys.argv[1:], "--variants", "--parallel")
            train_in_parallel(worker_argv, variants, a.parallel, out)
        rows = run_sweep(
            a.recipe, variants, widths, overrides, out, a.mlp_ratio, a.seeds, a.first_seed, not a.cells_only
        )
        if a.cells_only:
            return
        print(f"({time.time() - t0:.0f} s)")
        print(table(rows))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
