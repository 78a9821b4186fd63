"""Untrusted checkpoint files: refuse a pickle that would import code before anything unpickles it.

Every `.pt` file of a checkpoint is scanned for the globals its pickle would import (reading
the opcodes only; nothing in the file runs); anything outside torch's weights-only set and a
short allowlist is refused before any loader (ours, DeepSpeed's, zero_to_fp32) sees the file.
Every load then reads the file it scanned, from the same open file, with `weights_only=True`:
`safe_torch_load` for ours, and `guarded_torch_load()` around DeepSpeed's loaders (which ask
for `weights_only=False`), so a file swapped between the scan and the load is never unpickled
in full.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from torch.serialization import get_unsafe_globals_in_checkpoint

from common.deepspeed_import import import_deepspeed
from common.errors import UnsafeCheckpoint

# Globals a trainer checkpoint legitimately needs besides torch's own weights-only set:
# numpy arrays in the RNG state, and DeepSpeed's small bookkeeping classes in optimizer states.
CHECKPOINT_GLOBALS = (
    "numpy.dtype",
    "numpy.ndarray",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.dtypes.UInt32DType",
    "numpy.dtypes.Int64DType",
    "numpy.dtypes.Float64DType",
    "numpy._core.multiarray.scalar",
    "numpy.core.multiarray.scalar",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "collections.OrderedDict",
    "collections.defaultdict",
    "argparse.Namespace",
)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")
_torch_load = torch.load  # the real loader, whatever guarded_torch_load() puts in its place


def pickle_globals(path: str | os.PathLike | IO[bytes], name: str | None = None) -> list[str]:
    """Globals that unpickling `path` (a path or an open binary file) would import beyond torch's
    weights-only set. Reads the pickle opcodes only; nothing in the file is executed."""
    f = path if hasattr(path, "read") else str(path)
    try:
        return get_unsafe_globals_in_checkpoint(f)
    except Exception as e:  # noqa: BLE001 - not a torch zip file: treat as unreadable, refuse
        raise UnsafeCheckpoint(f"{name or path} is not a readable torch checkpoint file ({e})") from None


def scan_pickle(path: str | os.PathLike | IO[bytes], name: str | None = None) -> list[str]:
    """The globals of `path` that are neither torch's weights-only set nor allowlisted."""
    return [g for g in pickle_globals(path, name) if g not in CHECKPOINT_GLOBALS]


def _allowed_globals(path: str | os.PathLike | IO[bytes], name: str | None = None) -> list[str]:
    """The globals of `path`, after refusing the file if any of them is not allowed."""
    found = pickle_globals(path, name)
    _refuse_any([g for g in found if g not in CHECKPOINT_GLOBALS], name or path)
    return found


def _refuse_any(bad: list[str], path) -> None:
    if bad:
        raise UnsafeCheckpoint(
            f"{path} would import {bad} when loaded; a checkpoint written by this trainer never does, so it is "
            "refused (loading it could run code). Fix: use a checkpoint from a trusted run; if you wrote this file "
            "yourself and trust it, add the names to checkpoint.pickle_scan.CHECKPOINT_GLOBALS"
        )


def _allowlisted_objects(found) -> list[Any]:
    """The allowlist, imported; its DeepSpeed classes only where the file names one of them (`found`),
    so loading a checkpoint without them (a native or exported model) never imports DeepSpeed.
    (The others stay allowed whatever the file names: numpy builds dtype classes it does not name.)"""
    objs = []
    for name in CHECKPOINT_GLOBALS:
        if name.startswith("deepspeed.") and name not in found:
            continue
        mod, _, attr = name.rpartition(".")
        try:
            if mod.startswith("deepspeed."):
                import_deepspeed()
            objs.append(getattr(importlib.import_module(mod), attr))
        except (ImportError, AttributeError):
            continue
    return objs


def _load_allowed(f, found: list[str], map_location, **kwargs) -> Any:
    with torch.serialization.safe_globals(_allowlisted_objects(found)):
        return _torch_load(f, map_location=map_location, weights_only=True, **kwargs)


def safe_torch_load(path: str | os.PathLike | IO[bytes], map_location="cpu", **kwargs) -> Any:
    """torch.load with weights_only=True of the very file that was scanned (one open file for the
    scan and the load), refusing files that import non-allowlisted globals."""
    if not hasattr(path, "read"):
        if kwargs.get("mmap"):  # mmap needs the path: scan, then load weights-only (which allows no code)
            return _load_allowed(path, _allowed_globals(path), map_location, **kwargs)
        with open(path, "rb") as f:
            return safe_torch_load(f, map_location, **kwargs)
    start = path.tell()
    found = _allowed_globals(path, getattr(path, "name", "<file>"))
    path.seek(start)  # the load reads the bytes just scanned
    return _load_allowed(path, found, map_location, **kwargs)


@contextlib.contextmanager
def guarded_torch_load() -> Iterator[None]:
    """Within the block, every `torch.load` (DeepSpeed's loaders and converters call it with
    weights_only=False) scans the file and loads it weights-only from the same open file."""
    previous = torch.load

    def load(f, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
        if pickle_module is not None:
            raise UnsafeCheckpoint(f"{f}: a custom pickle_module is not allowed for checkpoint files")
        return safe_torch_load(f, map_location=map_location, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = previous


def verify_checkpoint_dir(tag_dir: str | os.PathLike) -> int:
    """Scan every pickle-based file of a checkpoint before DeepSpeed (which unpickles in full) reads it."""
    files = [f for f in sorted(Path(tag_dir).rglob("*")) if f.is_file() and f.suffix in PICKLE_SUFFIXES]
    for f in files:
        _refuse_any(scan_pickle(f), f)
    return len(files)
