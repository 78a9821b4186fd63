"""Token shard format, manifest, verification and memory-mapped reading.

Layout of a prepared directory (Megatron-style .bin/.idx, OLMo-style numpy memmap)::

    manifest.json          tokenizer identity, vocab size, dtype, per-shard counts and sha256
    shard_00000.bin        raw token ids (uint16 if the vocab fits, else uint32), EOS after each doc
    shard_00000.idx        .npy int64 array of document offsets into the .bin, [0, ..., n_tokens]

Why this shape: the loader maps shards with ``np.memmap`` and never reads a whole shard, so
memory does not grow with corpus size; the sha256 in the manifest lets a truncated or
corrupted shard be caught before training rather than as a NaN three days in.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .errors import DataError

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 1


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to ``path.tmp``, fsync, rename: readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_shard(out: Path, index: int, tokens: np.ndarray, offsets: np.ndarray, *, delay_s: float = 0.0) -> dict:
    """Write one shard under temporary names and rename it into place only when complete.

    The .idx is renamed before the .bin, and the manifest/progress file (written after this
    returns) is what makes a shard count as done, so a kill at any point leaves either
    no shard, a stray ``.tmp``, or a complete shard that a re-run rewrites identically.
    """
    name = shard_name(index)
    bin_path, idx_path = out / f"{name}.bin", out / f"{name}.idx"
    bin_tmp, idx_tmp = out / f"{name}.bin.tmp", out / f"{name}.idx.tmp"
    data = np.ascontiguousarray(tokens).tobytes()
    with open(bin_tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    with open(idx_tmp, "wb") as f:
        np.save(f, np.asarray(offsets, dtype=np.int64), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    if delay_s:
        import time

        time.sleep(delay_s)
    os.replace(idx_tmp, idx_path)
    os.replace(bin_tmp, bin_path)
    return {
        "name": name,
        "num_tokens": int(len(tokens)),
        "num_docs": int(len(offsets) - 1),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "idx_sha256": sha256_file(idx_path),
    }


def read_manifest(directory: str | os.PathLike) -> dict:
    """Read and sanity-check ``manifest.json`` of a prepared directory."""
    d = Path(directory)
    mpath = d / MANIFEST
    if not d.exists():
        raise DataError(
            f"data directory {d} does not exist; create it with "
            "'python -m data_pipeline.prepare --source FILES --tokenizer DIR --out DIR'"
        )
    if not mpath.is_file():
        if (d / PROGRESS).is_file():
            raise DataError(
                f"{mpath} is missing but {d / PROGRESS} exists: preparation was interrupted; "
                "re-run the same 'python -m data_pipeline.prepare' command to finish it"
            )
        raise DataError(
            f"{mpath} not found: {d} is not a prepared shard directory; create it with "
            "'python -m data_pipeline.prepare --source FILES --tokenizer DIR --out DIR'"
        )
    try:
        m = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{mpath} is not valid JSON ({e}); delete the directory and re-run prepare") from e
    required = ("format_version", "tokenizer_id", "vocab_size", "dtype", "eos_id", "shards", "num_tokens")
    missing = [k for k in required if k not in m]
    if missing:
        raise DataError(f"{mpath} lacks keys {missing}; it was not written by data_pipeline.prepare, re-run prepare")
    if m["format_version"] != FORMAT_VERSION:
        raise DataError(f"{mpath}: format_version {m['format_version']} is not supported (expected {FORMAT_VERSION}); re-run prepare")
    if not m.get("complete", False):
        raise DataError(f"{mpath} is marked incomplete; re-run the same prepare command to finish it")
    return m


def verify_shards(directory: str | os.PathLike, manifest: dict, *, mode: str = "full") -> None:
    """Check every shard against the manifest: size always; sha256 and max id when ``mode='full'``.

    Runs before any training step, so a bad shard is a clear error naming the file and the fix.
    """
    d = Path(directory)
    dtype = np.dtype(manifest["dtype"])
    vocab = int(manifest["vocab_size"])
    fix = "re-run 'python -m data_pipeline.prepare' into a fresh --out directory (or restore the file from a good copy)"
    for s in manifest["shards"]:
        bin_path, idx_path = d / f"{s['name']}.bin", d / f"{s['name']}.idx"
        for p in (bin_path, idx_path):
            if not p.is_file():
                raise DataError(f"shard file {p} listed in {d / MANIFEST} is missing; {fix}")
        size = bin_path.stat().st_size
        if size != s["num_tokens"] * dtype.itemsize:
            raise DataError(
                f"shard {bin_path} has {size} bytes but the manifest says {s['num_tokens']} tokens "
                f"({s['num_tokens'] * dtype.itemsize} bytes): the file is truncated or was overwritten; {fix}"
            )
        if mode == "full":
            if sha256_file(bin_path) != s["sha256"]:
                raise DataError(f"shard {bin_path} fails its sha256 check against {d / MANIFEST} (corrupted bytes); {fix}")
            if "idx_sha256" in s and sha256_file(idx_path) != s["idx_sha256"]:
                raise DataError(f"document index {idx_path} fails its sha256 check against {d / MANIFEST}; {fix}")
            arr = np.memmap(bin_path, dtype=dtype, mode="r")
            step = 1 << 24
            for a in range(0, len(arr), step):
                mx = int(arr[a:a + step].max())
                if mx >= vocab:
                    raise DataError(
                        f"shard {bin_path} contains token id {mx} >= vocab_size {vocab} from {d / MANIFEST}: "
                        f"it was made with a different tokenizer; {fix}"
                    )
            del arr
        offs = np.load(idx_path, mmap_mode="r")
        if len(offs) != s["num_docs"] + 1 or (len(offs) and (int(offs[0]) != 0 or int(offs[-1]) != s["num_tokens"])):
            raise DataError(f"document index {idx_path} does not match {s['name']}.bin and the manifest; {fix}")


class ShardSet:
    """One prepared directory viewed as a single memory-mapped token stream.

    ``read(a, b)`` returns tokens ``[a, b)`` of the concatenation of all shards (in manifest
    order); ``doc_ids(a, b)`` the global document index of each of those positions.
    Shards are opened lazily, so only the pages actually read are ever resident.
    """

    def __init__(self, directory: str | os.PathLike, manifest: dict | None = None):
        self.dir = Path(directory)
        self.manifest = manifest or read_manifest(self.dir)
        self.dtype = np.dtype(self.manifest["dtype"])
        shards = self.manifest["shards"]
        self.names = [s["name"] for s in shards]
        self.tok_starts = np.zeros(len(shards) + 1, dtype=np.int64)
        self.tok_starts[1:] = np.cumsum([s["num_tokens"] for s in shards])
        self.doc_starts = np.zeros(len(shards) + 1, dtype=np.int64)
        self.doc_starts[1:] = np.cumsum([s["num_docs"] for s in shards])
        self.num_tokens = int(self.tok_starts[-1])
        self._bins: dict[int, np.ndarray] = {}
        self._idx: dict[int, np.ndarray] = {}

    def _bin(self, i: int) -> np.ndarray:
        a = self._bins.get(i)
        if a is None:
            a = self._bins[i] = np.memmap(self.dir / f"{self.names[i]}.bin", dtype=self.dtype, mode="r")
        return a

    def _offsets(self, i: int) -> np.ndarray:
        a = self._idx.get(i)
        if a is None:
            a = self._idx[i] = np.load(self.dir / f"{self.names[i]}.idx", mmap_mode="r")
        return a

    def _pieces(self, a: int, b: int):
        s = int(np.searchsorted(self.tok_starts, a, side="right")) - 1
        while a < b:
            lo = a - int(self.tok_starts[s])
            hi = min(b, int(self.tok_starts[s + 1])) - int(self.tok_starts[s])
            yield s, lo, hi
            a = int(self.tok_starts[s]) + hi
            s += 1

    def read(self, a: int, b: int) -> np.ndarray:
        parts = [self._bin(s)[lo:hi] for s, lo, hi in self._pieces(a, b)]
        return parts[0].astype(np.int64) if len(parts) == 1 else np.concatenate(parts).astype(np.int64)

    def doc_ids(self, a: int, b: int) -> np.ndarray:
        parts = []
        for s, lo, hi in self._pieces(a, b):
            offs = self._offsets(s)
            pos = np.arange(lo, hi, dtype=np.int64)
            parts.append(np.searchsorted(offs, pos, side="right") - 1 + self.doc_starts[s])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
