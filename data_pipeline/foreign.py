"""Token datasets other trainers wrote, read in place (no re-tokenization):

- `megatron:PREFIX`: a Megatron-LM / GPT-NeoX indexed dataset, PREFIX.bin (the tokens) and PREFIX.idx
  (the MMIDIDX header, dtype code, sequence lengths and pointers, document index);
- `olmo:FILE[,FILE...]`: OLMo-style token arrays, uint16/uint32 memmaps (raw, `data.token_dtype`, or
  .npy with a header) of EOS-separated documents, in order.

Either is a `ShardSet` (one "shard" per file), so the project's loader reads it exactly as it reads
its own shards: deterministic, resumable and world-size-independent. Weighted lists of prefixes are
a `mixture` of such sources (`mixture:megatron:/a=0.3,megatron:/b=0.7`). These files carry no
manifest, so the recipe states `data.vocab_size` and `data.eos_id` (and `data.tokenizer` for a
tokenizer identity); every file is scanned once at start, and a token id >= vocab_size is refused
before training.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from common.errors import DataError

from .shards import ShardSet

MEGATRON, OLMO = "megatron:", "olmo:"
MMIDIDX = b"MMIDIDX\x00\x00"
# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py); only integer token types.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
OLMO_DTYPES = ("uint16", "uint32")
SCAN_TOKENS = 1 << 24  # tokens per chunk of the one-time scan (max id, EOS count)


def is_foreign(location: str) -> bool:
    return isinstance(location, str) and location.startswith((MEGATRON, OLMO))


def check_foreign(location: str, vocab_size: int | None, eos_id: int | None, token_dtype: str | None) -> None:
    """What a foreign source needs from the recipe, checked before anything is opened."""
    if vocab_size is None or eos_id is None:
        raise DataError(
            f"data.source {location}: a {location.split(':')[0]} dataset carries no manifest, so the recipe must "
            "state its vocabulary and end-of-document token. Fix: set data.vocab_size and data.eos_id"
        )
    if not isinstance(eos_id, int) or isinstance(eos_id, bool) or not 0 <= eos_id < vocab_size:
        raise DataError(f"data.eos_id must be an int in [0, data.vocab_size={vocab_size}), got {eos_id!r}")
    if token_dtype is not None and token_dtype not in OLMO_DTYPES:
        raise DataError(f"data.token_dtype must be one of {OLMO_DTYPES} (raw OLMo arrays), got {token_dtype!r}")


def read_megatron_index(prefix: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(token dtype, sequence lengths, sequence byte pointers, document index) of PREFIX.idx."""
    idx = Path(prefix + ".idx")
    try:
        raw = idx.read_bytes()
    except OSError as e:
        raise DataError(
            f"megatron:{prefix}: cannot read {idx} ({e}). Fix: give the prefix of a .bin/.idx pair"
        ) from None
    head = len(MMIDIDX) + 8 + 1 + 8 + 8
    if len(raw) < head or raw[: len(MMIDIDX)] != MMIDIDX:
        raise DataError(f"{idx}: not a Megatron indexed dataset (no MMIDIDX header). Fix: give a .bin/.idx prefix")
    pos = len(MMIDIDX)
    (version,) = struct.unpack_from("<Q", raw, pos)
    (code,) = struct.unpack_from("<B", raw, pos + 8)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, pos + 9)
    if version != 1 or code not in DTYPE_CODES:
        raise DataError(f"{idx}: version {version}, dtype code {code}; this reader takes version 1 and integer tokens")
    need = head + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(raw) < need:
        raise DataError(f"{idx}: {len(raw)} bytes, but its header promises {need} (truncated)")
    sizes = np.frombuffer(raw, np.int32, n_seq, head)
    pointers = np.frombuffer(raw, np.int64, n_seq, head + 4 * n_seq)
    docs = np.frombuffer(raw, np.int64, n_doc, head + 12 * n_seq)
    return np.dtype(DTYPE_CODES[code]), sizes, pointers, docs


_SCANS: dict[tuple, tuple[int, int]] = {}


def _scan(path: Path, tokens: np.ndarray, eos_id: int) -> tuple[int, int]:
    """(largest token id, EOS count) of a file, once per process per file version."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, eos_id)
    if key not in _SCANS:
        top, eos = -1, 0
        for a in range(0, len(tokens), SCAN_TOKENS):
            chunk = np.asarray(tokens[a : a + SCAN_TOKENS])
            top = max(top, int(chunk.max()) if len(chunk) else -1)
            eos += int(np.count_nonzero(chunk == eos_id))
        _SCANS[key] = (top, eos)
    return _SCANS[key]


class ForeignShards(ShardSet):
    """A foreign dataset as a ShardSet: `read`, `gather`, `doc_ids` work unchanged over its memmaps."""

    def __init__(self, location: str, vocab_size: int, eos_id: int, token_dtype: str | None = None, tokenizer_id=None):
        self.where = location
        kind, _, rest = location.partition(":")
        self.dir = Path(rest.split(",")[0])
        self._maps: list[np.ndarray] = []
        self._doc_offsets: list[np.ndarray | None] = []
        shards, digest = [], hashlib.sha256(location.encode())
        if kind + ":" == MEGATRON:
            dtype, sizes, pointers, docs = read_megatron_index(rest)
            path = Path(rest + ".bin")
            if not path.is_file():
                raise DataError(f"megatron:{rest}: {path} does not exist. Fix: give the prefix of a .bin/.idx pair")
            n = int(sizes.sum(dtype=np.int64))
            expected = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]) * dtype.itemsize
            if not np.array_equal(pointers, expected) or path.stat().st_size != n * dtype.itemsize:
                raise DataError(
                    f"{path}: {path.stat().st_size} bytes, but its .idx describes {n} contiguous tokens of {dtype}. "
                    "Fix: rebuild the pair, or give the matching prefix"
                )
            self._add(path, np.memmap(path, dtype=dtype, mode="r"), vocab_size, eos_id)
            starts = pointers[docs[:-1]] // dtype.itemsize if len(docs) > 1 else np.zeros(0, np.int64)
            self._doc_offsets[-1] = np.asarray(starts, dtype=np.int64)
            shards.append({"name": path.name, "num_tokens": n, "num_docs": int(len(docs) - 1)})
            digest.update(_head(Path(rest + ".idx")))
        else:
            for name in filter(None, rest.split(",")):
                path = Path(name)
                tokens = _olmo_array(path, token_dtype)
                _, eos = self._add(path, tokens, vocab_size, eos_id)
                ends_open = len(tokens) and tokens[-1] != eos_id
                shards.append({"name": path.name, "num_tokens": len(tokens), "num_docs": eos + int(bool(ends_open))})
                st = path.stat()
                digest.update(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
            if not shards:
                raise DataError(f"{location}: no files. Fix: olmo:FILE[,FILE...]")
        self.fingerprint = digest.hexdigest()
        dtypes = {m.dtype for m in self._maps}
        self.manifest = {
            "dtype": str(self._maps[0].dtype) if len(dtypes) == 1 else "int64",
            "shards": shards,
            "tokenizer_id": tokenizer_id or f"unnamed:vocab{vocab_size}:eos{eos_id}",  # without data.tokenizer
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "pad_id": eos_id,
        }
        self._init_index()
        self.dtype = np.result_type(*dtypes)

    def _add(self, path: Path, tokens: np.ndarray, vocab_size: int, eos_id: int) -> tuple[int, int]:
        top, eos = _scan(path, tokens, eos_id)
        if top >= vocab_size:
            raise DataError(
                f"{path}: token id {top} >= data.vocab_size={vocab_size}; the recipe's vocabulary does not match "
                "this dataset. Fix: set data.vocab_size to the tokenizer's size"
            )
        self._maps.append(tokens)
        self._doc_offsets.append(None)
        return top, eos

    def _bin(self, i: int) -> np.ndarray:
        return self._maps[i]

    def _offsets(self, i: int) -> np.ndarray:
        """Token offsets where each document of file i starts (OLMo: after every EOS, found once)."""
        if self._doc_offsets[i] is None:
            ends = np.flatnonzero(np.asarray(self._maps[i]) == self.manifest["eos_id"]) + 1
            self._doc_offsets[i] = np.concatenate([[0], ends[ends < len(self._maps[i])]]).astype(np.int64)
        return self._doc_offsets[i]


def _head(path: Path, n: int = 1 << 20) -> bytes:
    """A file's first MiB and its size: what the fingerprint of an index hashes."""
    with open(path, "rb") as f:
        return f.read(n) + str(os.fstat(f.fileno()).st_size).encode()


def _olmo_array(path: Path, token_dtype: str | None) -> np.ndarray:
    """A memmap of one OLMo token file: .npy (its header names the dtype) or raw (`token_dtype`)."""
    try:
        with open(path, "rb") as f:
            npy = f.read(6) == b"\x93NUMPY"
    except OSError as e:
        raise DataError(f"olmo:{path}: cannot read it ({e}). Fix: olmo:FILE[,FILE...] of token arrays") from None
    if npy:
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32):
            raise DataError(f"{path}: a {tokens.dtype} array of shape {tokens.shape}; expected 1-D uint16 or uint32")
        return tokens
    if token_dtype is None:
        raise DataError(
            f"{path} is a raw token array (no .npy header), so its dtype is not recorded. "
            "Fix: set data.token_dtype to uint16 or uint32"
        )
    size = path.stat().st_size
    if size % np.dtype(token_dtype).itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {token_dtype} tokens. Fix: data.token_dtype")
    return np.memmap(path, dtype=token_dtype, mode="r") if size else np.zeros(0, token_dtype)
