"""Where the trainer gets batches: `data_pipeline.build_loader`, or a small built-in byte reader.

The built-in reader covers `text:PATH` (raw UTF-8 text files read as bytes, vocab 256; no
tokenizer, no preparation step), for quick CPU runs on raw text such as WikiText-2. It keeps
the data pipeline's contract: each `next()` returns this rank's share [B // W, T] of one
global batch; the state is the GLOBAL number of sequences consumed, so a resume with another
world size continues the same order.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_pipeline.classification import ClassificationLoader
from data_pipeline.config import DataConfig
from data_pipeline.loader import build_loader


def make_loader(data: dict[str, Any], split: str, seq_len: int, global_batch_size: int,
                dp_rank: int, dp_world_size: int, seed: int, verify_record: str | Path | None = None):
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
    if source.startswith("text:"):
        return BuiltinLoader(data, split, seq_len, global_batch_size, dp_rank, dp_world_size)
    return build_loader(DataConfig.from_dict(data), split=split, seq_len=seq_len,
                        global_batch_size=global_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size,
                        verify_record=verify_record)


class BuiltinLoader:
    def __init__(self, data: dict[str, Any], split: str, seq_len: int, global_batch_size: int,
                 dp_rank: int, dp_world_size: int):
        known = {"source", "seed", "val_fraction"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"data: unknown keys {sorted(unknown)} for the built-in reader; known: {sorted(known)}")
        if global_batch_size % dp_world_size:
            raise ValueError(f"global batch {global_batch_size} is not divisible by {dp_world_size} data-parallel ranks")
        self.source = data["source"]
        self.seed = int(data.get("seed", 0))
        self.split = split
        self.T = seq_len
        self.B = global_batch_size
        self.rank, self.world = dp_rank, dp_world_size
        self.samples_seen = 0
        self._init_text(data)

    # ---- text: bytes of UTF-8 files ------------------------------------------------------
    def _init_text(self, data: dict[str, Any]) -> None:
        path = Path(self.source[len("text:"):])
        if not path.is_absolute() and not path.exists():
            path = Path(__file__).resolve().parent.parent / path     # relative to the repository
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"data.source={self.source!r}: no .txt files found")
        raw = b"".join(f.read_bytes() for f in files)
        tokens = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
        n_val = int(len(tokens) * float(data.get("val_fraction", 0.05)))
        self.tokens = tokens[len(tokens) - n_val:] if self.split == "val" else tokens[:len(tokens) - n_val]
        self.n_windows = (len(self.tokens) - 1) // self.T
        if self.n_windows < 1:
            raise ValueError(f"{self.source}: split {self.split!r} is shorter than one sequence of {self.T}")
        self.vocab_size = 256
        self.tokenizer_id = "bytes"
        self._perm_epoch, self._perm = -1, None

    def _text_sample(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, k = divmod(j, self.n_windows)
        if self.split == "val":
            w = k
        else:
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
                self._perm_epoch = epoch
            w = int(self._perm[k])
        seg = self.tokens[w * self.T: w * self.T + self.T + 1]
        return seg[:-1], seg[1:]

    # ---- iterator contract -------------------------------------------------------------
    def _sample(self, j: int):
        return self._text_sample(j)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        per = self.B // self.world
        start = self.samples_seen + self.rank * per
        xs, ys = zip(*(self._sample(j) for j in range(start, start + per)))
        self.samples_seen += self.B
        return {"input_ids": torch.from_numpy(np.stack(xs)), "labels": torch.from_numpy(np.stack(ys))}

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen, "source": self.source, "seed": self.seed,
                "fingerprint": hashlib.sha1(f"{self.source}|{self.seed}|{self.T}".encode()).hexdigest()[:12]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("source", self.source) != self.source or d.get("seed", self.seed) != self.seed:
            raise ValueError(f"loader state is for source={d.get('source')!r} seed={d.get('seed')}, "
                             f"but the recipe has source={self.source!r} seed={self.seed}")
        self.samples_seen = int(d["samples_seen"])
