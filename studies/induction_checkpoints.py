"""Induction probes on a trained run's kept checkpoints: did a mechanism form between two of them?

    python -m studies.induction_checkpoints --runs outputs/scaling/isoflop_seeds_large/runs/standard-w96-s1 \
        --rows docs/data/induction/scaling_checkpoints.jsonl
    python -m studies.induction_checkpoints --rows docs/data/induction/scaling_checkpoints.jsonl --render

A scaling chain's stable run keeps a checkpoint at every branch step, so its checkpoints span the budgets
the IsoFLOP grid measured. Each is loaded (checkpoint.load_for_eval) and probed exactly as the induction
study probes a run during training (studies/induction.py, InductionProbe: every head's induction and
previous-token scores on repeated random tokens and on repeated chunks of the held-out text, the repeat
predicted, Olsson et al.'s in-context learning score), on the run's own held-out text (the first of its
`data.val_sets`: the Linux documentation for the scaling recipe). One row per checkpoint: the run, its
variant, width and seed, the step, tokens, training FLOPs (model.flops at the run's sequence length) and
the run's validation losses at its last evaluation at or before that step (`val_step`). A checkpoint whose row exists is skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from checkpoint.load import load_for_eval
from common.cli import run_cli
from common.errors import StudyError
from eval.report import markdown_table
from model.flops import flops_per_token
from pretrain.config import load_recipe
from pretrain.metrics import read_metrics

from .induction import InductionProbe, held_out
from .rows import append_row, read_rows
from .shared import study_parser

KEEP = ("probe/induction_score_text", "probe/prev_token_score_text", "probe/repeat_text_acc",
        "probe/repeat_text_loss", "probe/repeat_text_first_loss", "probe/icl_score", "probe/induction_score",
        "probe/prev_token_score")  # fmt: skip


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the run's complete checkpoints, in order."""
    tags = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return [int(p.name.split("_")[1]) for p in tags if (p / "COMPLETE").is_file()]


def probe_checkpoint(run_dir: Path, step: int) -> dict[str, Any]:
    """One row: the checkpoint at `step` probed on the run's held-out text, beside what the run logged there."""
    cfg = load_recipe(run_dir / "config.yaml")
    tokens, token_range = held_out(cfg)
    model, meta = load_for_eval(run_dir / "checkpoints" / f"step_{step:08d}")
    if int(meta["step"]) != step:
        raise StudyError(f"{run_dir}: checkpoint step_{step:08d} holds step {meta['step']}. Fix: remove the stray tag")
    with torch.no_grad():
        scores = InductionProbe(tokens, token_range)(model.eval(), step)
    evals = [r for r in read_metrics(run_dir) if "val_loss" in r and r["step"] <= step]  # the last one at or before
    logged = evals[-1] if evals else {}
    tokens_seen = int(meta.get("tokens_seen") or step * cfg.train.global_batch_sequences * cfg.train.seq_len)
    return {
        "run": str(run_dir),
        "variant": model.cfg.variant,
        "width": model.cfg.hidden_size,
        "seed": cfg.seed,
        "step": step,
        "tokens": tokens_seen,
        "flops": tokens_seen * flops_per_token(model.cfg, cfg.train.seq_len)["train"],
        "val_step": logged.get("step"),
        **{k: v for k, v in logged.items() if k == "val_loss" or k.startswith("val_loss/")},
        **{k.removeprefix("probe/"): float(scores[k]) for k in KEEP},
    }


def render(rows: list[dict[str, Any]]) -> str:
    """Markdown: per run, every probed checkpoint in step order."""
    header = ["run", "step", "FLOPs", "val loss linux-doc", "induction (text)", "previous-token (text)",
              "repeat acc (text)", "repeat loss, 2nd copy / 1st", "ICL score"]  # fmt: skip
    lines = [
        [Path(r["run"]).name, r["step"], f"{r['flops']:.2e}", f"{r.get('val_loss/linux-doc', float('nan')):.3f}",
         f"{r['induction_score_text']:.3f}", f"{r['prev_token_score_text']:.3f}", f"{100 * r['repeat_text_acc']:.1f} %",
         f"{r['repeat_text_loss']:.2f} / {r['repeat_text_first_loss']:.2f}", f"{r['icl_score']:+.3f}"]
        for r in sorted(rows, key=lambda r: (r["variant"] != "standard", r["run"], r["step"]))
    ]  # fmt: skip
    return markdown_table(header, lines, align="lrrrrrrrr")


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.induction_checkpoints", __doc__)
    ap.add_argument("--runs", nargs="*", default=[], help="run dirs whose kept checkpoints are probed")
    ap.add_argument("--rows", required=True, help="JSON lines, one per probed checkpoint (appended)")
    ap.add_argument("--render", action="store_true", help="print the table of the rows and probe nothing")
    args = ap.parse_args(argv)

    def body() -> int:
        runs = [Path(r) for r in args.runs]
        for run in runs:
            if not (run / "config.yaml").is_file() or not checkpoint_steps(run):
                raise StudyError(f"{run} is not a run dir with complete checkpoints. Fix: pass RUN (RUN/checkpoints)")
        if not args.render:
            torch.set_num_threads(1)
            for run in runs:
                done = {r["step"] for r in read_rows(args.rows) if r["run"] == str(run)}
                for step in (s for s in checkpoint_steps(run) if s not in done):
                    row = probe_checkpoint(run, step)
                    append_row(Path(args.rows), row)
                    print(f"{run.name} step {step}: induction {row['induction_score_text']:.3f}, "
                          f"icl {row['icl_score']:+.3f}")  # fmt: skip
        print(render(read_rows(args.rows)))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
