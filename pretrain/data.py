"""Where the trainer gets batches: the recipe's `data.source` routed to the data pipeline's loaders.

- `classify:...` -> data_pipeline.classification (sequence classification);
- `text:PATH` -> data_pipeline.text (UTF-8 text read by the byte tokenizer, no preparation step);
- a prepared shard dir, a mixture or `synthetic:<task>` -> data_pipeline.loader.

Every loader keeps one contract: each `next()` returns this rank's share [B // W, T] of one global
batch; the state is the GLOBAL number of sequences consumed, so a resume with another world size
continues the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data_pipeline.classification import ClassificationLoader
from data_pipeline.config import DataConfig
from data_pipeline.loader import build_loader
from data_pipeline.text import PREFIX as TEXT_PREFIX
from data_pipeline.text import TextLoader


def make_loader(
    data: dict[str, Any],
    split: str,
    seq_len: int,
    global_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    verify_record: str | Path | None = None,
):
    """A per-rank batch iterator for the recipe's `data` section.

    `verify_record`: a directory all ranks share (the run dir): shards are sha256-checked once
    there and recorded, later starts and the other ranks only check sizes."""
    data = dict(data)
    source = str(data.get("source", ""))
    if not source:
        raise ValueError("data.source is required (a prepared shard dir, 'synthetic:<task>' or 'text:PATH')")
    data.setdefault("seed", seed)
    if source.startswith("classify:"):
        return ClassificationLoader(data, split, seq_len, global_batch_size, dp_rank, dp_world_size)
    if source.startswith(TEXT_PREFIX):
        return TextLoader(data, split, seq_len, global_batch_size, dp_rank, dp_world_size)
    return build_loader(
        DataConfig.from_dict(data),
        split=split,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        verify_record=verify_record,
    )
