"""Untrusted checkpoint files: refuse a pickle that would import code before anything unpickles it.

Every `.pt` file of a checkpoint is scanned for the globals its pickle would import (reading
the opcodes only; nothing in the file runs); anything outside torch's weights-only set and a
short allowlist is refused before any loader (ours, DeepSpeed's, zero_to_fp32) sees the file.
Our own files are then read with `weights_only=True`.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch
from torch.serialization import get_unsafe_globals_in_checkpoint

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
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file would import something outside the allowlist when unpickled."""


def scan_pickle(path: str | os.PathLike) -> list[str]:
    """Globals that unpickling `path` would import and that are neither torch's weights-only
    set nor allowlisted. Reads the pickle opcodes only; nothing in the file is executed."""
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
        "trust it, add the names to checkpoint.pickle_scan.CHECKPOINT_GLOBALS")


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
        if f.is_file() and f.suffix in PICKLE_SUFFIXES:
            bad = scan_pickle(f)
            if bad:
                raise _refuse(f, bad)
            n += 1
    return n
