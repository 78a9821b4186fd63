"""Writing and reading the engine's checkpoints (the tag-dir format is checkpoint/tags.py).

A save is collective: every rank writes its DeepSpeed files, the data-parallel rank 0 of each
pipeline stage its frozen tensors, every rank its RNG state; only after a barrier that every
rank reaches when it has finished writing does rank 0 mark the tag complete and move `latest`.
A load scans every pickle before DeepSpeed unpickles anything.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoint import tags
from checkpoint.pickle_scan import verify_checkpoint_dir

from . import faults
from .errors import CheckpointWriteFailed


def save(trainer, run_dir: Path, step: int, trainer_state: dict[str, Any], keep_last: int) -> Path:
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO  # deferred: heavy (deepspeed)
    root = tags.ckpt_root(run_dir)
    tag = tags.tag_for(step)
    tag_dir = root / tag
    rank = dist.get_rank()
    if rank == 0 and tag_dir.exists():
        shutil.rmtree(tag_dir)                    # rewriting a tag: start from an empty dir
    dist.barrier()
    trainer.engine.save_checkpoint(str(root), tag=tag, client_state={UNIVERSAL_CHECKPOINT_INFO: {},
                                                                    "trainer_state": trainer_state},
                                   save_latest=False)
    frozen = trainer.frozen_tensors()      # collective under ZeRO-3: every rank takes part
    stage = trainer.engine.stage_id if trainer.pipe else 0
    if trainer.dp_rank == 0:
        tags.save_frozen(tag_dir, stage, frozen)
    tags.save_rng(tag_dir, rank)
    faults.pause("save", step)
    dist.barrier()                      # every rank has finished writing
    if rank == 0:
        tags.finalize(run_dir, tag_dir, trainer_state, keep_last)
    dist.barrier()
    return tag_dir


def load(trainer, tag_dir: Path, universal: bool, seed: int) -> None:
    """Weights, optimizer, frozen tensors and this rank's RNG (re-seeded from `seed` when the
    checkpoint has none for this rank, e.g. a universal checkpoint)."""
    verify_checkpoint_dir(tag_dir)     # before DeepSpeed unpickles anything
    path, _ = trainer.engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True,
                                             load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {tag_dir}")
    trainer.restore_frozen(tags.load_frozen(tag_dir))
    if not tags.load_rng(tag_dir, dist.get_rank()):
        torch.manual_seed(seed + dist.get_rank())


def write_failed(exc: OSError, tag_dir: Path, run_dir: Path) -> CheckpointWriteFailed:
    """Remove the partial checkpoint (never marked complete) and say what is still good."""
    shutil.rmtree(tag_dir, ignore_errors=True)
    latest = tags.latest_checkpoint(run_dir)
    return CheckpointWriteFailed(
        f"could not write checkpoint {tag_dir.name} ({exc.strerror or exc}); the partial files were removed and the "
        f"last complete checkpoint {latest if latest else '(none yet)'} is untouched. Fix: free space under "
        f"{run_dir} (or lower checkpoint.keep_last), then rerun with --resume auto")
