"""The run directory a run owns: where it is, what config it records, and refusing to write
into a directory that holds another run."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import yaml

from common.constants import REPO_ROOT
from common.errors import RecipeError
from model import ModelConfig

from .config import SECTIONS, RunConfig

# Settings that may change when a run continues (more steps, other logging or layout).
MUTABLE = {
    "train": (
        "max_steps",
        "max_tokens",
        "eval_every_steps",
        "eval_batches",
        "device",
        "nan_policy",
        "max_nan_skips",
        "micro_batch_sequences",
        "activation_checkpointing",
    ),
    "checkpoint": None,
    "logging": None,
    "parallel": None,
    # the learning-rate schedule: a resume checks it against the checkpoint's own (pretrain/resume.py)
    "optim": (
        "lr",
        "min_lr",
        "warmup_steps",
        "decay",
        "decay_steps",
        "decay_fraction",
        "decay_start",
        "allow_schedule_change",
    ),
    # where the shards live and how they are fetched: a run may move between local and remote
    # storage (the loader's own fingerprint refuses a different token stream)
    "data": (
        "source",
        "storage_options",
        "cache_dir",
        "cache_max_gb",
        "cache_block_kb",
        "retries",
        "retry_backoff_s",
        "prefetch",
        "val_sets",
    ),
}


def default_run_dir(cfg: RunConfig) -> Path:
    return REPO_ROOT / "runs" / cfg.name


def resolved_config(cfg: RunConfig, mcfg) -> dict[str, Any]:
    """The recipe with the model section resolved to the full ModelConfig (what config.yaml records)."""
    d = cfg.to_dict()
    d["model"] = mcfg.to_dict()
    return d


def run_identity(resolved: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for sec, body in resolved.items():
        keep = MUTABLE.get(sec, ())
        if sec == "name" or keep is None:
            continue
        out[sec] = {k: v for k, v in body.items() if k not in keep} if isinstance(body, dict) else body
    return out


def with_new_defaults(old: dict[str, Any]) -> dict[str, Any]:
    """A config.yaml written before a model or section field existed, with that field at its default: the
    run was trained with the behaviour the default keeps, so it resumes; a non-default value is a change."""
    sections = {"model": ModelConfig, **SECTIONS}
    out = dict(old)
    for sec, cls in sections.items():
        if isinstance(out.get(sec), dict):
            defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
            out[sec] = {**{k: v for k, v in defaults.items() if k not in out[sec]}, **out[sec]}
    return out


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: there {va!r}, here {vb!r}")
    return out


def check_run_dir(run_dir: Path, resolved: dict[str, Any], resume: str | None, overwrite: bool) -> None:
    """Refuse a run directory that holds another run (rank 0, before any work): with `--resume never`,
    or with `--resume auto` when its config.yaml describes another run (model, data, batch, seed ...;
    the differences named); `overwrite` instead clears its checkpoints, metrics and TensorBoard files."""
    run_dir = Path(run_dir)
    cfg_file = run_dir / "config.yaml"
    holds_run = cfg_file.is_file() or (run_dir / "checkpoints").is_dir() or (run_dir / "metrics.jsonl").is_file()
    if not holds_run:
        return
    if overwrite:
        for sub in ("checkpoints", "tb", "universal"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
        for f in ("metrics.jsonl", "config.yaml", "nonfinite.jsonl"):
            (run_dir / f).unlink(missing_ok=True)
        return
    if resume in (None, "", "never"):
        raise RecipeError(
            f"{run_dir} already holds a run (config.yaml, checkpoints or metrics) and --resume never "
            "was given. Fix: --resume auto to continue it, --overwrite to replace it, or another "
            "--run-dir"
        )
    if resume != "auto" or not cfg_file.is_file():
        return
    try:
        old = yaml.safe_load(cfg_file.read_text()) or {}
    except yaml.YAMLError:
        return
    diffs = _diff(run_identity(with_new_defaults(old)), run_identity(resolved))
    if diffs:
        raise RecipeError(
            f"{run_dir} holds a different run ({'; '.join(diffs[:6])}). Fix: another --run-dir, "
            "--overwrite to replace it, or the recipe that run was started with"
        )


def write_config(run_dir: Path, resolved: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))


def read_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The resolved recipe a run recorded (its model section a full ModelConfig), or None when the run
    dir has none yet or it is unreadable (the trainer's own check of the run dir reports that)."""
    path = Path(run_dir) / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return cfg if isinstance(cfg, dict) else None


RESTARTS = "restarts.jsonl"  # launch.sh --max-restarts appends one line per restart


def restart_count(run_dir: Path) -> int:
    """How many times launch.sh restarted this run (its restarts.jsonl lines)."""
    path = Path(run_dir) / RESTARTS
    return len(path.read_text().splitlines()) if path.is_file() else 0
