"""How long a checkpoint save blocks the training step: synchronous saves against background saves.

    .venv/bin/python benchmarks/bench_checkpoint.py [--preset s] [--steps 24] [--every 4] [--out DIR] [--record FILE]

Trains the same run twice on the CPU (one process, `recipes/tiny_cpu.yaml` at the chosen preset,
synthetic data), saving every `--every` steps, once with `checkpoint.background=false` and once
with `true`. For each save the loop records the seconds the step was blocked (serialising into host
memory, for a background save) and the seconds until the tag was marked COMPLETE
(`RunResult.saves`). Prints one table: per mode, the median of both over the saves and the blocked
time as a share of the save's own duration and of a synchronous save's (the goal for background
saves: under 10 %), the checkpoint's size, and whether both runs had the same losses; `--record FILE` appends it to FILE.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from checkpoint import tag_format  # noqa: E402
from pretrain.train import train  # noqa: E402


def run(preset: str, steps: int, every: int, background: bool, run_dir: Path):
    over = [
        f"model.preset={preset}",
        f"train.max_steps={steps}",
        f"checkpoint.every_steps={every}",
        "checkpoint.keep_last=2",
        f"checkpoint.background={str(background).lower()}",
        "train.eval_every_steps=0",
        "logging.tensorboard=false",
        "logging.progress_bar='off'",
        "logging.every_steps=1000",
    ]
    return train("recipes/tiny_cpu.yaml", over, run_dir=run_dir, resume="never", overwrite=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="s")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument(
        "--out", default=None, help="where the runs go (default: a temporary dir; its disk is what is timed)"
    )
    ap.add_argument("--record", default=None, help="append the table to this file")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_ckpt_"))
    results = {mode: run(args.preset, args.steps, args.every, mode, root / str(mode)) for mode in (False, True)}
    tag = tag_format.latest_checkpoint(root / "True")
    size = sum(f.stat().st_size for f in tag.rglob("*") if f.is_file()) / 2**20
    lines = [
        f"preset {args.preset}, {args.steps} steps, a save every {args.every}; checkpoint {size:.1f} MiB",
        "",
        "| saves | n | step blocked (median s) | until COMPLETE (median s) | blocked / its save's duration "
        "| blocked / a synchronous save's |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    sync = statistics.median(s.complete_s for s in results[False].saves)
    for mode, res in results.items():
        blocked = statistics.median(s.blocked_s for s in res.saves)
        complete = statistics.median(s.complete_s for s in res.saves)
        name = "background" if mode else "synchronous"
        lines.append(
            f"| {name} | {len(res.saves)} | {blocked:.4f} | {complete:.4f} | {blocked / complete:.1%} "
            f"| {blocked / sync:.1%} |"
        )
    lines.append(f"\nsame losses: {results[False].losses == results[True].losses}")
    print("\n" + "\n".join(lines))
    if args.record:
        with open(args.record, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
