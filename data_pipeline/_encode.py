"""Worker side of ``prepare``: tokenise a batch of documents into one flat array.

Kept import-light (numpy + the tokenizer wrapper) because worker processes are spawned
fresh and each one imports this module.
"""

from __future__ import annotations

import numpy as np

from .tokenizer import load_tokenizer

_TOK = None


def init_worker(tokenizer_path: str) -> None:
    global _TOK

    _TOK = load_tokenizer(tokenizer_path)


def encode_docs(texts: list[str], tok=None, num_threads: int = 1) -> tuple[np.ndarray, np.ndarray, int]:
    """Return (tokens with EOS after each kept doc, per-doc lengths incl. EOS, max id).

    Whitespace-only documents get length 0 and no tokens: they carry no text, and
    skipping them by a fixed rule keeps shards identical however the work is split.
    """
    tok = tok or _TOK
    lengths = np.zeros(len(texts), dtype=np.int64)
    keep = [i for i, t in enumerate(texts) if t and not t.isspace()]
    if not keep:
        return np.zeros(0, dtype=np.int64), lengths, -1
    encoded = tok.encode_batch([texts[i] for i in keep], num_threads=num_threads)
    eos = tok.eos_id
    for i, ids in zip(keep, encoded):
        ids.append(eos)
        lengths[i] = len(ids)
    flat = np.fromiter((t for ids in encoded for t in ids), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths, int(flat.max())
