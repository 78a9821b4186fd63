"""Throughput accounting (FLOPs: model/flops.py; MFU: model/mfu.py) and the run's own record: metrics.jsonl
and the console (the trackers, TensorBoard among them, are callbacks: pretrain/trackers.py)."""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data_pipeline.progress import is_terminal
from model.flops import flops_per_token


def train_flops_per_token(mcfg, seq_len: int, step: int = 0, causal_half: bool = False) -> tuple[float, str]:
    """(forward+backward FLOPs per token at `step`, source): model.flops, frozen weights'
    gradient work excluded, the freeze schedule in effect at that step; `causal_half`: attention's
    causal half only (the `mfu_causal` beside the convention's `mfu`)."""
    return float(flops_per_token(mcfg, seq_len, step=step, causal_half=causal_half)["train"]), "model.flops"


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers but its step: what TensorBoard and the trackers receive."""
    return {
        k: float(v)
        for k, v in rec.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def memory_gib(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "mem_alloc_gib": torch.cuda.memory_allocated(device) / 2**30,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        }
    return {"mem_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record a run's Logger wrote to RUN_DIR/metrics.jsonl, in order (what studies and plots read)."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def last_step(run_dir: str | Path) -> int:
    """The last step in a run's metrics.jsonl (0: none yet), read while its process may be writing a line."""
    metrics = Path(run_dir) / "metrics.jsonl"
    for line in reversed(metrics.read_text().splitlines() if metrics.is_file() else []):
        with contextlib.suppress(json.JSONDecodeError, KeyError):
            return int(json.loads(line)["step"])
    return 0


class Logger:
    """Rank 0's record. `log(record)` appends one JSON line and prints a console line (or, on a terminal
    with logging.progress_bar auto/on, updates a bar)."""

    def __init__(self, run_dir: Path, enabled: bool, progress_bar: str, total_steps: int, start_step: int):
        self.enabled = enabled
        self.bar = None
        self.peak: tuple[float | None, str] = (None, "unknown")  # MFU's (TFLOP/s per device, source): model/mfu.py
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
        # A bar only where it can redraw in place: written to a log (CI, Slurm, `> log`) every refresh
        # becomes a line, so there each record prints one line instead, whatever the setting.
        if progress_bar != "off" and is_terminal(sys.stderr):
            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True)

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps after the checkpoint (they will be recomputed)."""
        if not self.enabled or not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue
        self.path.write_text("".join(x + "\n" for x in keep))

    def log(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        line = format_line(rec)
        if self.bar is not None:
            self.bar.n = rec["step"]
            self.bar.set_postfix_str(line, refresh=True)
        else:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def metric_name(k: str) -> str:
    """A record key's name in TensorBoard, W&B and MLflow alike, by group: `train/` (loss, lr, grad norm),
    `val/` (val_loss -> val/loss, val_loss/<set> -> val/loss/<set>), `throughput/`, `memory/`; keys
    already grouped (`eval/...`, a hook's `probe/...`) keep their name. metrics.jsonl keeps the keys."""
    if k == "val_loss" or k.startswith("val_loss/"):
        return "val/loss" + k[len("val_loss") :]
    if "/" in k:
        return k
    if k.startswith("val"):
        return f"val/{k}"
    if k in ("tokens_per_s", "tflops", "mfu", "mfu_causal", "step_time_s"):
        return f"throughput/{k}"
    if k.startswith("mem"):
        return f"memory/{k}"
    return f"train/{k}"


def named_scalars(rec: dict[str, Any]) -> dict[str, float]:
    """`scalars` under their `metric_name`: what every sink but metrics.jsonl receives."""
    return {metric_name(k): v for k, v in scalars(rec).items()}


def format_line(rec: dict[str, Any]) -> str:
    parts = [f"step {rec['step']}"]
    for k, fmt in (
        ("loss", "{:.4f}"),
        ("val_loss", "{:.4f}"),
        ("lr", "{:.2e}"),
        ("grad_norm", "{:.3f}"),
        ("tokens_seen", "{:,}"),
        ("tokens_per_s", "{:,.0f}"),
        ("tflops", "{:.3f}"),
        ("mfu", "{:.1%}"),
    ):
        v = rec.get(k)
        if v is not None:
            parts.append(f"{k} " + fmt.format(v))
    if rec.get("mfu_causal") is not None:
        parts[-1] += f" (causal half {rec['mfu_causal']:.1%})"
    return " | ".join(parts)
