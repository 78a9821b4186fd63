"""Data pipeline: tokenizer, shard preparation, deterministic loader, synthetic tasks.

Public entry points::

    from data_pipeline import DataConfig
    from data_pipeline.loader import build_loader
    from data_pipeline.tokenizer import load_tokenizer
    loader = build_loader(DataConfig(source="shards/"), split="train", seq_len=2048,
                          global_batch_size=256, dp_rank=rank, dp_world_size=world)

The package itself imports only the light config and error types, so the CLIs and the
tokeniser worker processes start without torch.
"""

from .config import DataConfig

__all__ = ["DataConfig"]
