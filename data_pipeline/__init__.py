"""Data pipeline: tokenizer, shard preparation, deterministic loader, synthetic tasks.

Public entry points::

    from data_pipeline import DataConfig, build_loader, load_tokenizer
    loader = build_loader(DataConfig(source="shards/"), split="train", seq_len=2048,
                          global_batch_size=256, dp_rank=rank, dp_world_size=world)

Heavy modules (torch, transformers) are imported on first use, so the CLIs and the
tokeniser worker processes start quickly.
"""
from .config import DataConfig
from .errors import DataError

__all__ = ["DataConfig", "DataError", "Loader", "build_loader", "load_tokenizer"]


def __getattr__(name):
    if name in ("Loader", "build_loader"):
        from . import loader

        return getattr(loader, name)
    if name == "load_tokenizer":
        from .tokenizer import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module 'data_pipeline' has no attribute {name!r}")
