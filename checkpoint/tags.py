"""Trainer checkpoint directories: what a tag dir holds and when it counts as complete.

Both the trainer (which writes them) and the evaluation side (which reads them) stand on
this module; it knows nothing of either.

Layout of `RUN/checkpoints/<tag>/` (tag = `step_00000042`):
- DeepSpeed's files (`mp_rank_*_model_states.pt`, `*_optim_states.pt`, or pipeline
  `layer_*-model_states.pt`): model, optimizer moments, fp32 master weights;
- `trainer_state.json`: step, tokens seen, loader position, the step whose frozen set
  the optimizer was built for, the resolved recipe and model config;
- `frozen-stage<S>.safetensors`: every frozen tensor of pipeline stage S, in its own dtype
  (gathered under ZeRO-3), restored verbatim on resume and used by the exporter;
- `rng/rank<R>.pt`: each rank's torch / numpy / python RNG states;
- `COMPLETE`: written by rank 0 after a barrier that every rank reaches only when it
  has finished writing. Only then does `RUN/checkpoints/latest` (the tag, one line)
  move, through an atomic rename. Retention deletes the oldest complete checkpoints
  beyond `keep_last`, never the newest complete one, and never one that is not older
  than it.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .pickle_scan import safe_torch_load

TAG_RE = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"
STATE = "trainer_state.json"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def ckpt_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(tag_dir: str | os.PathLike) -> bool:
    p = Path(tag_dir)
    return (p / COMPLETE).is_file() and (p / STATE).is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, sorted by step."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = TAG_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` points to if it is complete, else the newest complete one."""
    root = ckpt_root(run_dir)
    ptr = root / "latest"
    if ptr.is_file():
        tag = ptr.read_text().strip()
        if tag and is_complete(root / tag):
            return root / tag
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def read_state(tag_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(tag_dir) / STATE).read_text())


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(tag_dir: Path, rank: int) -> None:
    (tag_dir / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tag_dir / "rng" / f"rank{rank}.pt")


def load_rng(tag_dir: Path, rank: int) -> bool:
    f = Path(tag_dir) / "rng" / f"rank{rank}.pt"
    if not f.is_file():
        return False
    set_rng_state(safe_torch_load(f))     # weights_only=True, allowlisted globals
    return True


def save_frozen(tag_dir: Path, stage: int, tensors: dict[str, torch.Tensor]) -> None:
    tag_dir.mkdir(parents=True, exist_ok=True)
    path = tag_dir / f"frozen-stage{stage}.safetensors"
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def load_frozen(tag_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(tag_dir).glob("frozen-stage*.safetensors")):
        out.update(load_file(str(f)))
    return out


def finalize(run_dir: Path, tag_dir: Path, state: dict[str, Any], keep_last: int) -> None:
    """Rank 0, after every rank has finished writing: mark complete, move `latest`, prune."""
    atomic_write(tag_dir / STATE, json.dumps(state, indent=1, sort_keys=True, default=str))
    atomic_write(tag_dir / COMPLETE, "ok\n")
    atomic_write(ckpt_root(run_dir) / "latest", tag_dir.name + "\n")
    prune(run_dir, keep_last)


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete the oldest complete checkpoints beyond keep_last (never the newest complete one)."""
    if keep_last <= 0:
        return []
    ckpts = list_checkpoints(run_dir)
    newest = latest_checkpoint(run_dir)
    removed = []
    for _, p in ckpts[:-keep_last]:
        if newest is not None and p.resolve() == newest.resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """`auto` -> latest complete checkpoint of run_dir (or None); `never`/None -> None;
    a path -> that checkpoint tag dir, or the latest in a run dir, its checkpoints/ dir, or any dir
    of tag dirs (e.g. the output of pretrain.universal)."""
    if resume in (None, "", "never"):
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    p = Path(resume)
    if is_complete(p):
        return p
    for cand in (p, p.parent):
        if (cand / "checkpoints").is_dir() and latest_checkpoint(cand) is not None and cand == p:
            return latest_checkpoint(cand)
    if p.name == "checkpoints" and latest_checkpoint(p.parent) is not None:
        return latest_checkpoint(p.parent)
    tag_dirs = sorted((int(m.group(1)), c) for c in (p.iterdir() if p.is_dir() else ())
                      if (m := TAG_RE.match(c.name)) and is_complete(c))
    if tag_dirs:
        return tag_dirs[-1][1]
    raise FileNotFoundError(f"--resume {resume}: no complete checkpoint there (expected a run dir, its "
                            f"checkpoints/ dir, or a tag dir containing {STATE} and {COMPLETE})")
