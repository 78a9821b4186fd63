"""Training checkpoint directories: what a tag dir holds and when it counts as complete.

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
- `COMPLETE`: written last, after every file is fsynced, listing every file with its size (and
  small ones' sha256; `mark_complete`); only then does `RUN/checkpoints/latest` move. `verify`
  checks a checkpoint against it; a marker of the older form (`ok`, no list) is accepted unverified.

`latest` is untrusted input: a name that leads out of `RUN/checkpoints/` (a path, `..`, a
symlinked tag dir) is refused (`UnsafeCheckpoint`), never followed; a name that is not one of
our tags is ignored.
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

from common.constants import atomic_write, file_sha256, fsync_path
from common.errors import UnsafeCheckpoint

from .pickle_scan import safe_torch_load

TAG_RE = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"
STATE = "trainer_state.json"
MARKER_FORMAT = 2  # COMPLETE holds the file list (format 1: the text "ok")
CHECKSUM_MAX_BYTES = 1 << 20  # files up to this size get a sha256 in the marker; larger ones their size


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def ckpt_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(tag_dir: str | os.PathLike) -> bool:
    p = Path(tag_dir)
    return (p / COMPLETE).is_file() and (p / STATE).is_file()


def _inside(root: Path, p: Path) -> bool:
    return p.resolve().parent == root.resolve()


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, sorted by step (a tag dir that resolves outside
    `checkpoints/`, e.g. a symlink, is not one)."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = TAG_RE.match(p.name)
        if m and p.is_dir() and _inside(root, p) and is_complete(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_tag_dir(run_dir: str | os.PathLike) -> Path | None:
    """The tag dir `RUN/checkpoints/latest` names (complete or not); None without a pointer or
    when it names something that is not one of our tags (e.g. DeepSpeed's `global_stepN`).
    Refuses a name that leads out of the checkpoints directory."""
    root = ckpt_root(run_dir)
    ptr = root / "latest"
    if not ptr.is_file():
        return None
    tag = ptr.read_text().strip()
    if not tag:
        return None
    if "/" in tag or "\\" in tag or tag in (".", "..") or not _inside(root, root / tag):
        raise UnsafeCheckpoint(
            f"{ptr} names {tag[:200]!r}, which leads out of {root}; it is refused, not "
            f"followed. Fix: write the tag of a checkpoint of this run (step_NNNNNNNN) into {ptr}, "
            "or delete it (the newest complete checkpoint is then used)"
        )
    return root / tag if TAG_RE.match(tag) else None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` points to if it is complete, else the newest complete one."""
    tag_dir = latest_tag_dir(run_dir)
    if tag_dir is not None and is_complete(tag_dir):
        return tag_dir
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def newest_good_checkpoint(run_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint whose files match its marker: the one `latest` points to,
    else the newest complete one older than it. Returns it and one note per checkpoint passed over
    (which, and why), for the caller to report."""
    latest = latest_checkpoint(run_dir)
    ckpts = list_checkpoints(run_dir)
    if latest is None:
        return None, []
    step = int(TAG_RE.match(latest.name).group(1))
    candidates = [latest] + [p for s, p in reversed(ckpts) if s < step]
    notes = []
    for p in candidates:
        problems = verify(p)
        if not problems:
            return p, notes
        notes.append(f"checkpoint {p} fails verification ({'; '.join(problems[:3])}); it is skipped")
    return None, notes


def read_state(tag_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(tag_dir) / STATE).read_text())


def file_list(tag_dir: Path) -> dict[str, dict[str, Any]]:
    """Every file of a tag dir but the marker: relative path -> bytes (and sha256 when small)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(tag_dir.rglob("*")):
        rel = f.relative_to(tag_dir).as_posix()
        if not f.is_file() or rel == COMPLETE:
            continue
        entry: dict[str, Any] = {"bytes": f.stat().st_size}
        if entry["bytes"] <= CHECKSUM_MAX_BYTES:
            entry["sha256"] = file_sha256(f).hexdigest()
        out[rel] = entry
    return out


def mark_complete(tag_dir: Path) -> dict[str, dict[str, Any]]:
    """fsync every file and directory of the tag dir, then write the marker listing them
    (atomically, fsynced). Returns the list."""
    for p in sorted(tag_dir.rglob("*"), reverse=True):  # files before the directories holding them
        fsync_path(p)
    fsync_path(tag_dir)
    files = file_list(tag_dir)
    atomic_write(tag_dir / COMPLETE, json.dumps({"format": MARKER_FORMAT, "files": files}, indent=1, sort_keys=True))
    return files


def verify(tag_dir: str | os.PathLike) -> list[str]:
    """What is wrong with a complete-looking checkpoint: files missing, of another size than the
    marker lists (truncated by a crash), or failing their checksum. [] when it is intact, or when
    its marker predates the file list (it cannot be checked)."""
    p = Path(tag_dir)
    try:
        text = (p / COMPLETE).read_text()
    except OSError as e:
        return [f"{COMPLETE} cannot be read ({e.strerror or e})"]
    if text.strip() == "ok":
        return []
    try:
        files = json.loads(text)["files"]
    except (ValueError, KeyError, TypeError):
        return [f"{COMPLETE} is not a valid file list (truncated?)"]
    problems = []
    if STATE not in files:
        problems.append(f"{COMPLETE} does not list {STATE}")
    for rel, entry in sorted(files.items()):
        f = p / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != entry.get("bytes"):
            problems.append(f"{rel} has {f.stat().st_size} bytes, the marker lists {entry.get('bytes')}")
        elif "sha256" in entry and file_sha256(f).hexdigest() != entry["sha256"]:
            problems.append(f"{rel} fails its sha256 check")
    return problems


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


def rng_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / "rng" / f"rank{rank}.pt"


def save_rng(tag_dir: Path, rank: int, state: dict[str, Any] | None = None) -> None:
    """This process's RNG states now (or `state`, taken earlier) as `rng/rank<R>.pt`."""
    (tag_dir / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state() if state is None else state, rng_file(tag_dir, rank))


def load_rng(tag_dir: Path, rank: int) -> bool:
    f = rng_file(Path(tag_dir), rank)
    if not f.is_file():
        return False
    set_rng_state(safe_torch_load(f))  # weights_only=True, allowlisted globals
    return True


def frozen_file(tag_dir: Path, stage: int) -> Path:
    return tag_dir / f"frozen-stage{stage}.safetensors"


def save_frozen(tag_dir: Path, stage: int, tensors: dict[str, torch.Tensor]) -> None:
    tag_dir.mkdir(parents=True, exist_ok=True)
    path = frozen_file(tag_dir, stage)
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
    mark_complete(tag_dir)
    atomic_write(ckpt_root(run_dir) / "latest", tag_dir.name + "\n")
    prune(run_dir, keep_last)


def discard(tag_dir: Path) -> None:
    """Remove a checkpoint that could not be written: the marker first, so a crash in the middle
    never leaves a complete-looking remainder."""
    (tag_dir / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(tag_dir, ignore_errors=True)


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


def resolve_resume(resume: str | None, run_dir: Path) -> tuple[Path | None, list[str]]:
    """`auto` -> the newest intact checkpoint of run_dir (or None); `never`/None -> None;
    a path -> that checkpoint tag dir (refused if it fails verification), or the newest intact
    one of a run dir, its checkpoints/ dir, or any dir of tag dirs (e.g. pretrain.universal's
    output). Also returns notes on checkpoints passed over."""
    if resume in (None, "", "never"):
        return None, []
    if resume == "auto":
        found, notes = newest_good_checkpoint(run_dir)
        if found is None and notes:
            raise FileNotFoundError(
                f"--resume auto: {run_dir} has complete checkpoints but none is intact "
                f"({' '.join(notes[:3])}). Fix: --resume PATH of a checkpoint you trust, or "
                "--resume never --overwrite to start the run over"
            )
        return found, notes
    p = Path(resume)
    if is_complete(p):
        problems = verify(p)
        if problems:
            raise FileNotFoundError(
                f"--resume {resume}: the checkpoint fails verification ({'; '.join(problems[:3])}): "
                "it was damaged after it was written (or by a crash before its files reached the "
                "disk). Fix: resume from an earlier checkpoint of the run"
            )
        return p, []
    run = p if (p / "checkpoints").is_dir() else p.parent if p.name == "checkpoints" else None
    if run is not None:
        found, notes = newest_good_checkpoint(run)
        if found is not None:
            return found, notes
    tag_dirs = sorted(
        (int(m.group(1)), c)
        for c in (p.iterdir() if p.is_dir() else ())
        if (m := TAG_RE.match(c.name)) and is_complete(c)
    )
    for _, c in reversed(tag_dirs):
        if not verify(c):
            return c, []
    raise FileNotFoundError(
        f"--resume {resume}: no intact complete checkpoint there (expected a run dir, its "
        f"checkpoints/ dir, or a tag dir containing {STATE} and {COMPLETE})"
    )
