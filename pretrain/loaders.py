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


def check_data(cfg: RunConfig, dp_world_size: int, verify_record: Path | None = None):
    """The training data's first loader (its vocabulary sizes the model), and a held-out split when the
    run evaluates: bad, empty or corrupt data is reported here, before any model is built (by a run and by
    its --dry-run alike). Shards are sha256-checked (once per run where `verify_record` keeps the record)."""
    try:
        probe = loader(cfg, "train", 0, dp_world_size, verify_record=verify_record)
        if cfg.train.eval_every_steps:  # fail now, not at the first evaluation, if there is no val split
            if val_sets(cfg, 0, dp_world_size, verify_record, getattr(probe, "tokenizer_id", None)) is None:
                loader(cfg, "val", 0, dp_world_size, verify_record=verify_record)
    except ValueError as e:  # DataError and the built-in reader's errors name the file and the fix
        raise RecipeError(f"data: {e}") from None
    return probe


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
