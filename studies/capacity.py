"""Memorization capacity: bits stored per parameter by 2-layer models of each variant.

    python -m studies.capacity --recipe recipes/capacity_memorization.yaml --widths 16,32,64 --out-dir runs/capacity
    python -m studies.capacity --smoke --out-dir /tmp/capacity          # smallest configuration, seconds

For every (variant, width) the recipe is trained with the DeepSpeed trainer (pretrain.train,
world size 1) on data_pipeline.synthetic's `memorization` task (random labels for all pairs
(x1, x2)); the final checkpoint is scored on every pair (the eval harness's synthetic task
scoring), and the stored information is memorization_capacity_bits(n_pairs, n_labels, acc)
(a C-ary symmetric channel: n_pairs * (log2 C - H2(a) - (1-a) log2(C-1))). Reported: bits,
bits per trainable parameter (the paper's measure), bits per parameter overall. A model holds
at most its capacity only when the data set holds more bits than that (n_pairs * log2 C);
`data_bits` is shown so saturated rows (acc ~ 1: the data, not the model, is the limit) stand out.

Writes OUT/capacity.json and OUT/capacity.md (the table with the paper's numbers beside ours).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from checkpoint import load_for_eval
from data_pipeline.cli import CliParser, run_cli
from data_pipeline.synthetic import get_task
from eval.synthetic_tasks import evaluate_task
from pretrain.config import load_recipe
from pretrain.train import train

from .errors import STUDY_ERRORS

# Bits per trainable parameter, 2-layer models (Dong et al., "Attention Retrieves, MLP Memorizes").
PAPER_BITS_PER_PARAM = {"standard": 2.98, "frozen_qk": 2.25, "mixit": 2.18, "frozen_mlp": 1.13}
DEFAULT_VARIANTS = ("standard", "frozen_qk", "mixit", "frozen_mlp")
SMOKE = {"widths": (8,), "overrides": ["data.task_args={n1: 8, n2: 8, n_labels: 4}", "train.max_steps=20",
                                       "train.global_batch_sequences=64", "train.micro_batch_sequences=64"]}


def size_overrides(width: int, mlp_ratio: int = 3) -> list[str]:
    heads = 2 if width % 4 == 0 else 1
    return [f"model.hidden_size={width}", f"model.intermediate_size={mlp_ratio * width}", f"model.num_heads={heads}",
            "model.num_kv_heads=null"]


def run_cell(recipe: str, variant: str, width: int, overrides: list[str], run_dir: Path,
             mlp_ratio: int = 3) -> dict[str, Any]:

    over = list(overrides) + size_overrides(width, mlp_ratio) + [f"model.variant={variant}"]
    cfg = load_recipe(recipe, over)
    t0 = time.time()
    res = train(recipe, over, run_dir=run_dir, resume="never")
    model, info = load_for_eval(res.last_checkpoint)
    model.eval()
    args = {k: v for k, v in dict(cfg.data.get("task_args") or {}).items() if k not in ("n_val", "seed")}
    task = get_task("memorization", seed=int(cfg.data.get("seed", cfg.seed)), **args)
    ev = evaluate_task(model, task, n=task.n_pairs, split="train", batch_size=4096, info=info, progress=False)
    # The parameters a model of this size really has: the LM head is used (it predicts the label).
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    bits = task.capacity_bits(ev["acc"])
    return {"variant": variant, "width": width, "layers": model.cfg.num_layers, "params_total": total,
            "params_trainable": trainable, "n_pairs": task.n_pairs, "n_labels": task.n_labels,
            "data_bits": task.n_pairs * math.log2(task.n_labels), "acc": ev["acc"], "bits": bits,
            "bits_per_trainable_param": bits / max(1, trainable), "bits_per_param": bits / max(1, total),
            "final_loss": res.losses[max(res.losses)], "steps": res.final_step, "seconds": round(time.time() - t0, 1)}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| variant | width | params (trainable / total) | data bits | acc | bits | bits / trainable param | "
           "bits / param | max bits/trainable (over widths) | paper bits/param |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    best = {}
    for r in rows:
        best[r["variant"]] = max(best.get(r["variant"], 0.0), r["bits_per_trainable_param"])
    for r in rows:
        paper = PAPER_BITS_PER_PARAM.get(r["variant"])
        out.append(f"| {r['variant']} | {r['width']} | {r['params_trainable']:,} / {r['params_total']:,} | "
                   f"{r['data_bits']:,.0f} | {r['acc']:.3f} | {r['bits']:,.0f} | {r['bits_per_trainable_param']:.3f} | "
                   f"{r['bits_per_param']:.3f} | {best[r['variant']]:.3f} | {paper if paper is not None else '-'} |")
    return "\n".join(out)


def run_sweep(recipe: str, variants, widths, overrides: list[str], out_dir: Path, mlp_ratio: int = 3,
              log=print) -> list[dict[str, Any]]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for w in widths:
        for v in variants:
            r = run_cell(recipe, v, int(w), overrides, out_dir / f"{v}_w{w}", mlp_ratio)
            rows.append(r)
            log(f"{v:>18} width {w:>4}: acc {r['acc']:.3f}  bits {r['bits']:,.0f}  "
                f"bits/trainable {r['bits_per_trainable_param']:.3f}  ({r['seconds']}s)")
            (out_dir / "capacity.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out_dir / "capacity.md").write_text(table(rows) + "\n")
    return rows


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of widths (e.g. 16,32,64)") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: widths must be positive integers (e.g. 16,32,64)")
    return widths


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m studies.capacity", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--recipe", default="recipes/capacity_memorization.yaml")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--widths", type=_widths, default=[16, 32, 64], help="hidden sizes (intermediate = mlp-ratio x width)")
    ap.add_argument("--mlp-ratio", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="the smallest configuration: width 8, 64 pairs, 20 steps")
    ap.add_argument("--out-dir", default="runs/capacity")
    ap.add_argument("overrides", nargs="*", help="recipe overrides section.key=value, applied to every cell")
    a = ap.parse_args(argv)
    widths, overrides = list(a.widths), list(a.overrides)
    if a.smoke:
        widths, overrides = list(SMOKE["widths"]), SMOKE["overrides"] + overrides
    variants = [v for v in a.variants.split(",") if v]

    def body() -> None:
        for w in widths:            # every cell's recipe is checked before the first one trains
            for v in variants:
                load_recipe(a.recipe, list(overrides) + size_overrides(w, a.mlp_ratio) + [f"model.variant={v}"])
        rows = run_sweep(a.recipe, variants, widths, overrides, Path(a.out_dir), a.mlp_ratio)
        print(table(rows))

    return run_cli(body, STUDY_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
