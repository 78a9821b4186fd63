"""Reliability guards of the trainer: non-finite losses, failed collectives, untrusted files,
recipe types, run-directory ownership and paths.

- `StepGate` + `NanGuard`: a non-finite loss is detected after the forward and before the
  boundary `engine.step()` (every rank agrees through an all-reduce), and the wrapped inner
  optimizer then skips its update, so a NaN never reaches the weights or the Adam moments.
  `train.nan_policy` decides what happens next: `skip` (drop the batch, log it), `stop`
  (raise `NonFiniteLoss` naming the step and the batch), `rollback` (reload the last complete
  checkpoint and step over the offending batch). More than `train.max_nan_skips` events stop
  the run.
- `collective_failure`: a collective that failed (a peer died) or timed out (a peer hangs;
  `parallel.timeout_s`) becomes `RankFailure` with a message that says what to do.
- `scan_pickle` / `safe_torch_load` / `verify_checkpoint_dir`: every `.pt` file of a checkpoint
  is scanned for the globals its pickle would import (without unpickling it); anything outside
  a short allowlist is refused before any loader sees the file. Our own files are then read with
  `weights_only=True`.
- `check_types`: recipe values have the type their dataclass field declares.
- `check_run_dir`: an output directory that already holds a different run is refused unless
  the run is resumed or `--overwrite` is given.
- `check_name`: `name` (the default run dir `runs/<name>`) cannot climb out of `runs/`.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import os
import shutil
import types
import typing
from pathlib import Path
from typing import Any

import torch

from .config import RecipeError

NAN_POLICIES = ("skip", "stop", "rollback")


class NonFiniteLoss(RuntimeError):
    """The loss was NaN/inf and the policy (or the repeat limit) says stop."""


class RankFailure(RuntimeError):
    """A collective failed or timed out: another rank died or hangs."""


class CheckpointWriteFailed(RuntimeError):
    """Writing a checkpoint failed (e.g. no space left); earlier checkpoints are untouched."""


def checkpoint_write_failed(exc: OSError, tag_dir: Path, run_dir: Path) -> CheckpointWriteFailed:
    """Remove the partial checkpoint (never marked complete) and say what is still good."""
    from . import checkpointing as ckpt
    shutil.rmtree(tag_dir, ignore_errors=True)
    latest = ckpt.latest_checkpoint(run_dir)
    return CheckpointWriteFailed(
        f"could not write checkpoint {tag_dir.name} ({exc.strerror or exc}); the partial files were removed and the "
        f"last complete checkpoint {latest if latest else '(none yet)'} is untouched. Fix: free space under "
        f"{run_dir} (or lower checkpoint.keep_last), then rerun with --resume auto")


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file would import something outside the allowlist when unpickled."""


# ---- non-finite losses ------------------------------------------------------------------

class StepGate:
    """Wraps the innermost optimizer's `step` so that one update can be skipped.

    DeepSpeed calls the inner (torch) optimizer once per optimizer step on every rank, after
    gradient reduction and clipping; skipping it leaves the fp32 master weights, the moments and
    the Adam step count untouched (ZeRO copies the unchanged master weights back to the model).
    With `check_grads` (pipeline parallelism, where the loss is known only after the step), the
    gate itself decides: any non-finite gradient on any rank skips the update."""

    def __init__(self, optimizer, check_grads: bool = False):
        self.optimizer = optimizer
        self.skip_next = False
        self.check_grads = check_grads
        self.skipped = 0
        self._step = optimizer.step
        optimizer.step = self.step

    def _grads_finite(self) -> bool:
        import torch.distributed as dist
        bad = torch.zeros(1)
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    bad.fill_(1.0)
        dev = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        bad = bad.to(dev)
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def step(self, *args, **kwargs):
        skip = self.skip_next or (self.check_grads and not self._grads_finite())
        self.skip_next = False
        if skip:
            self.skipped += 1
            return None
        return self._step(*args, **kwargs)


def install_step_gate(trainer) -> StepGate:
    opt = trainer.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    trainer.gate = StepGate(inner, check_grads=trainer.pipe)
    return trainer.gate


def any_rank(flag: bool, device: torch.device, group=None) -> bool:
    """True on every rank when `flag` is true on any rank."""
    import torch.distributed as dist
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def is_finite(x: torch.Tensor | float) -> bool:
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x.detach()).all())
    return math.isfinite(x)


class NanGuard:
    """Applies `train.nan_policy` to a step whose loss was not finite (its update was skipped)."""

    def __init__(self, policy: str, max_events: int, skipped: list[int] | None = None):
        self.policy, self.max_events = policy, max_events
        self.skip_positions: set[int] = set(int(p) for p in (skipped or []))
        self.events = 0

    def on_nonfinite(self, step: int, position: int | None, batch_size: int, loss: float) -> str:
        """Returns 'skip' or 'rollback'; raises NonFiniteLoss for 'stop' or too many events."""
        self.events += 1
        where = (f"optimizer step {step + 1} (batch of global samples [{position}, {position + batch_size}) "
                 f"of the data order)" if position is not None else f"optimizer step {step + 1}")
        if self.policy == "stop":
            raise NonFiniteLoss(
                f"non-finite loss ({loss}) at {where}; the update was not applied and nothing was saved after it. "
                "Fix: lower optim.lr or raise optim.warmup_steps, check the data at that position, or set "
                "train.nan_policy=skip|rollback to step over such batches; then --resume auto")
        if self.events > self.max_events:
            raise NonFiniteLoss(
                f"non-finite loss ({loss}) at {where}: {self.events} non-finite steps in this process, more than "
                f"train.max_nan_skips={self.max_events}; stopping (the model diverges or the data is broken). "
                "Fix: lower optim.lr, check the data, or resume from an earlier checkpoint with --resume PATH")
        if position is not None:
            self.skip_positions.add(int(position))
        return self.policy


def loader_position(loader) -> int | None:
    """Global index of the first sample of the loader's next batch (None if it does not say)."""
    try:
        return int(loader.state_dict()["samples_seen"])
    except Exception:  # noqa: BLE001 - a loader without a position still trains; skips are then by step
        return None


def skip_marked_batches(loader, guard: NanGuard) -> int:
    """Advance the loader past batches that a rollback marked as offending; returns how many."""
    n = 0
    while guard.skip_positions:
        pos = loader_position(loader)
        if pos is None or pos not in guard.skip_positions:
            break
        next(loader)
        n += 1
    return n


# ---- failed or hung collectives ---------------------------------------------------------

def collective_failure(exc: BaseException) -> bool:
    """Does this exception come from a collective whose peer died or timed out?"""
    import torch.distributed as dist
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "connection closed by peer", "connection reset by peer", "timed out", "timeout", "gloo", "nccl",
        "broken pipe"))


def rank_failure_message(exc: BaseException, timeout_s: float, run_dir: Path) -> str:
    from . import checkpointing as ckpt
    latest = ckpt.latest_checkpoint(run_dir)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"a collective operation failed or waited more than parallel.timeout_s={timeout_s:g}s: another rank "
            f"died or hangs ({first[:300]}). This rank stops. Last complete checkpoint: "
            f"{latest if latest else 'none'}. Fix: find why the other rank stopped (its log), then restart every "
            "rank with --resume auto")


# ---- untrusted checkpoint files ---------------------------------------------------------

# Globals a trainer checkpoint legitimately needs besides torch's own weights-only set:
# numpy arrays in the RNG state, and DeepSpeed's small bookkeeping classes in optimizer states.
CHECKPOINT_GLOBALS = (
    "numpy.dtype", "numpy.ndarray", "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
    "numpy.dtypes.UInt32DType", "numpy.dtypes.Int64DType", "numpy.dtypes.Float64DType",
    "numpy._core.multiarray.scalar", "numpy.core.multiarray.scalar",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "collections.OrderedDict", "collections.defaultdict", "argparse.Namespace",
)


def scan_pickle(path: str | os.PathLike) -> list[str]:
    """Globals that unpickling `path` would import and that are neither torch's weights-only
    set nor allowlisted. Reads the pickle opcodes only; nothing in the file is executed."""
    from torch.serialization import get_unsafe_globals_in_checkpoint
    try:
        found = get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # noqa: BLE001 - not a torch zip file: treat as unreadable, refuse
        raise UnsafeCheckpoint(f"{path} is not a readable torch checkpoint file ({e})") from None
    return [g for g in found if g not in CHECKPOINT_GLOBALS]


def _allowlisted_objects(names) -> list[Any]:
    objs = []
    for name in names:
        if name not in CHECKPOINT_GLOBALS:
            continue
        mod, _, attr = name.rpartition(".")
        try:
            objs.append(getattr(importlib.import_module(mod), attr))
        except (ImportError, AttributeError):
            continue
    return objs


def _refuse(path, bad) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{path} would import {bad} when loaded; a checkpoint written by this trainer never does, so it is refused "
        "(loading it could run code). Fix: use a checkpoint from a trusted run; if you wrote this file yourself and "
        "trust it, add the names to pretrain.safety.CHECKPOINT_GLOBALS")


def safe_torch_load(path: str | os.PathLike, map_location="cpu") -> Any:
    """torch.load with weights_only=True, after refusing files that import non-allowlisted globals."""
    bad = scan_pickle(path)
    if bad:
        raise _refuse(path, bad)
    with torch.serialization.safe_globals(_allowlisted_objects(CHECKPOINT_GLOBALS)):
        return torch.load(path, map_location=map_location, weights_only=True)


def verify_checkpoint_dir(tag_dir: str | os.PathLike) -> int:
    """Scan every pickle-based file of a checkpoint before DeepSpeed (which unpickles in full) reads it."""
    n = 0
    for f in sorted(Path(tag_dir).rglob("*")):
        if f.is_file() and f.suffix in (".pt", ".pth", ".bin", ".pkl", ".ckpt"):
            bad = scan_pickle(f)
            if bad:
                raise _refuse(f, bad)
            n += 1
    return n


# ---- recipe values ----------------------------------------------------------------------

def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, args[0]) for v in value) if args else \
            isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def check_types(section: str, obj: Any) -> None:
    """Every field of a recipe dataclass holds a value of its declared type (ints for floats are fine)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        tp = hints.get(f.name, Any)
        if not _type_ok(v, tp):
            want = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
            raise RecipeError(f"{section}.{f.name}={v!r} has type {type(v).__name__}; expected {want}. "
                              f"Fix: e.g. {section}.{f.name}={f.default!r}" if f.default is not dataclasses.MISSING
                              else f"{section}.{f.name}={v!r} has type {type(v).__name__}; expected {want}")


def check_name(name: Any) -> None:
    """`name` picks runs/<name>: one plain path component, so nothing is written outside runs/."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or os.path.isabs(name):
        raise RecipeError(f"name={name!r} must be a single directory name (no '/', '..' or absolute path): it "
                          "becomes runs/<name>. Fix: name: my_run, or give --run-dir DIR")


def check_inside(root: Path, path: Path) -> Path:
    """`path` resolved, refusing anything outside `root` (for file names built from config values)."""
    r, p = Path(root).resolve(), Path(path).resolve()
    if p != r and r not in p.parents:
        raise RecipeError(f"{path} is outside the run directory {root}; refusing to write there")
    return p


# ---- run-directory ownership ------------------------------------------------------------

# Settings that may change when a run continues (more steps, other logging or layout).
MUTABLE = {"train": ("max_steps", "max_tokens", "eval_every_steps", "eval_batches", "device", "nan_policy",
                     "max_nan_skips", "micro_batch_sequences", "activation_checkpointing"),
           "checkpoint": None, "logging": None, "parallel": None, "optim": ("decay_steps",)}


def run_identity(resolved: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for sec, body in resolved.items():
        if sec == "name":
            continue
        keep = MUTABLE.get(sec, ())
        if keep is None:
            continue
        out[sec] = {k: v for k, v in body.items() if k not in keep} if isinstance(body, dict) else body
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
    """Refuse to write into a run directory that holds another run (rank 0, before any work).

    - the directory holds a run and `--resume never`: refuse unless `overwrite` (which clears the
      run's checkpoints, metrics and TensorBoard files);
    - `--resume auto` and the stored config.yaml describes another run (model, data, batch,
      seed ...): refuse, naming the differences, unless `overwrite`.
    """
    import yaml
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
        raise RecipeError(f"{run_dir} already holds a run (config.yaml, checkpoints or metrics) and --resume never "
                          "was given. Fix: --resume auto to continue it, --overwrite to replace it, or another "
                          "--run-dir")
    if resume != "auto" or not cfg_file.is_file():
        return
    try:
        old = yaml.safe_load(cfg_file.read_text()) or {}
    except yaml.YAMLError:
        return
    diffs = _diff(run_identity(old), run_identity(resolved))
    if diffs:
        raise RecipeError(f"{run_dir} holds a different run ({'; '.join(diffs[:6])}). Fix: another --run-dir, "
                          "--overwrite to replace it, or the recipe that run was started with")
