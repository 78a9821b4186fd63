"""Load any checkpoint this repository writes, for evaluation, export or fine-tuning.

Accepted paths: a native dir (model.safetensors + config.json, model/io.py), a trainer tag
dir (checkpoint/tag_format.py; any ZeRO stage or pipeline layout), a run dir (its latest complete
checkpoint), or a HuggingFace dir (safetensors only, never remote code).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from common.errors import CorruptCheckpoint
from model import io as mio
from model.hf_format import import_hf

from . import tag_format
from .consolidate import model_from_checkpoint

_STEP_RE = re.compile(r"(\d+)")


def is_hf_dir(p: str | Path) -> bool:
    p = Path(p)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors")) and not mio.is_native(p)


def _hf_meta(p: Path) -> dict[str, Any]:
    for name in ("trainer_meta.json", "meta.json"):
        if (p / name).is_file():
            return json.loads((p / name).read_text())
    return {}


# What a truncated or garbled safetensors / JSON / pickle file raises when read.
_CORRUPT = (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, EOFError)


def load_for_eval(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """(model, meta) from a native dir, an HF dir, a trainer tag dir or a run dir (latest).
    meta has step, tokens_seen, tokenizer_id, variant, data (the recipe's section, when recorded).
    Raises FileNotFoundError saying what was expected, CorruptCheckpoint for an unreadable file and
    UnsafeCheckpoint for a pickle that would import code."""
    try:
        return _load_for_eval(Path(path), device)
    except _CORRUPT as e:
        raise CorruptCheckpoint(
            f"{path}: a checkpoint file is corrupt or truncated ({type(e).__name__}: {e}). "
            "Fix: use an earlier checkpoint of the run, or write this one again"
        ) from e


def _load_for_eval(p: Path, device: str | torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    if not p.exists():
        raise FileNotFoundError(
            f"{p} does not exist. Fix: pass a run dir, a checkpoint tag dir (RUN/checkpoints/"
            "step_N), or a native or HuggingFace model dir"
        )
    if mio.is_native(p):
        model, meta = mio.load_native(p, device=device)
        meta = dict(meta)
        meta.setdefault("variant", model.cfg.variant)
        return model, meta
    if tag_format.is_complete(p):
        problems = tag_format.verify(p)
        if problems:
            raise FileNotFoundError(
                f"{p} fails verification against its {tag_format.COMPLETE} marker ({'; '.join(problems[:3])}). "
                "Fix: use an earlier checkpoint"
            )
        return model_from_checkpoint(p, device)
    if (p / tag_format.STATE).is_file():
        raise FileNotFoundError(
            f"{p} is an incomplete checkpoint (no {tag_format.COMPLETE} marker: the save was "
            "interrupted). Fix: use an earlier checkpoint"
        )
    if (p / "checkpoints").is_dir() or p.name == "checkpoints":
        run = p if (p / "checkpoints").is_dir() else p.parent
        latest, notes = tag_format.newest_good_checkpoint(run)
        if latest is None:
            raise FileNotFoundError(
                f"run dir {run} has no intact complete checkpoint under checkpoints/"
                + (f" ({'; '.join(notes)})" if notes else "")
            )
        return model_from_checkpoint(latest, device)
    if is_hf_dir(p):
        model = import_hf(p).to(device)
        meta = _hf_meta(p)
        meta.setdefault("variant", model.cfg.variant)
        for k in ("step", "tokens_seen", "tokenizer_id"):
            meta.setdefault(k, None)
        return model, meta
    raise FileNotFoundError(
        f"no checkpoint at {p}: expected a native dir (model.safetensors + config.json), an HF "
        f"dir (config.json + *.safetensors), a checkpoint tag dir ({tag_format.STATE} + {tag_format.COMPLETE}) "
        "or a run dir with checkpoints/"
    )


def run_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every checkpoint of a run as (step, path), oldest first: its complete trainer tag dirs, or
    (for runs whose checkpoints/ holds exports) native and HF dirs, stepped by their meta or name."""
    run_dir = Path(run_dir)
    found = tag_format.list_checkpoints(run_dir)
    if found:
        return found
    ck = run_dir / "checkpoints"
    for p in sorted(ck.iterdir()) if ck.is_dir() else []:
        if mio.is_native(p):
            step = mio.read_native_config(p)[1].get("step")
        elif is_hf_dir(p):
            step = _hf_meta(p).get("step")
        else:
            continue
        if step is None:
            m = _STEP_RE.findall(p.name)
            step = int(m[-1]) if m else None
        if step is not None:
            found.append((int(step), p))
    return sorted(found)
