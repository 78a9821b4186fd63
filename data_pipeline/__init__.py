"""Data pipeline: tokenizer, shard preparation, deterministic loader, synthetic tasks.

Public entry points::

    from data_pipeline import DataConfig, build_loader, load_tokenizer
    loader = build_loader(DataConfig(source="shards/"), split="train", seq_len=2048,
                          global_batch_size=256, dp_rank=rank, dp_world_size=world)
"""
from .config import DataConfig
from .errors import DataError
from .loader import Loader, build_loader
from .tokenizer import load_tokenizer

__all__ = ["DataConfig", "DataError", "Loader", "build_loader", "load_tokenizer"]
