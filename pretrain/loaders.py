"""The recipe's data at this rank's share of the global batch: the training and held-out loaders and the
named validation sets. Apart from the config, so that reading a recipe builds nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.errors import RecipeError
from data_pipeline.loader import build_loader, build_val_sets

from .config import RunConfig


def loader(cfg: RunConfig, split: str, dp_rank: int = 0, dp_world_size: int = 1, verify_record: Path | None = None):
    """This rank's batches of the recipe's data. `verify_record`: a directory all ranks share (the run
    dir): shards are sha256-checked once there and recorded; later starts and other ranks check sizes."""
    if cfg.data is None:
        raise RecipeError(
            "data.source is required. Fix: add a data section (a shard dir, 'synthetic:<task>', 'text:PATH', ...)"
        )
    return build_loader(cfg.data, split=split, **_batching(cfg, dp_rank, dp_world_size, verify_record))


def val_sets(
    cfg: RunConfig, dp_rank: int = 0, dp_world_size: int = 1, verify_record: Path | None = None, tokenizer_id=None
):
    """Loaders of the recipe's named validation sets (`data.val_sets`), or None when it names none."""
    batching = _batching(cfg, dp_rank, dp_world_size, verify_record)
    return build_val_sets(cfg.data, tokenizer_id=tokenizer_id, **batching)


def _batching(cfg: RunConfig, dp_rank: int, dp_world_size: int, verify_record: Path | None) -> dict[str, Any]:
    """The loader arguments every split shares: the batch's shape and this rank's share of it."""
    return dict(
        seq_len=cfg.train.seq_len,
        global_batch_size=cfg.global_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        verify_record=verify_record,
    )
