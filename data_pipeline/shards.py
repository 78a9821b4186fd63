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

import fcntl
import hashlib
import io
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from common.constants import atomic_write, file_sha256
from common.errors import DataError

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 1


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


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
    idx = io.BytesIO()
    np.save(idx, np.asarray(offsets, dtype=np.int64), allow_pickle=False)
    _write_synced(bin_tmp, data)
    _write_synced(idx_tmp, idx.getvalue())
    if delay_s:
        time.sleep(delay_s)
    os.replace(idx_tmp, idx_path)
    os.replace(bin_tmp, bin_path)
    return {
        "name": name,
        "num_tokens": int(len(tokens)),
        "num_docs": int(len(offsets) - 1),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "idx_sha256": hashlib.sha256(idx.getvalue()).hexdigest(),
    }


def parse_manifest(text: bytes | str, where: str) -> dict:
    """Check the JSON text of a manifest (``where`` names it in errors: a path or a URL)."""
    try:
        m = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{where} is not valid JSON ({e}). Fix: delete the directory and re-run prepare") from e
    if not isinstance(m, dict):
        raise DataError(f"{where} is not a manifest (a JSON object). Fix: re-run prepare")
    required = ("format_version", "tokenizer_id", "vocab_size", "dtype", "eos_id", "shards", "num_tokens")
    missing = [k for k in required if k not in m]
    if missing:
        raise DataError(
            f"{where} lacks keys {missing}: it was not written by data_pipeline.prepare. Fix: re-run prepare"
        )
    if m["format_version"] != FORMAT_VERSION:
        raise DataError(
            f"{where}: format_version {m['format_version']} is not supported (expected {FORMAT_VERSION}). Fix: re-run prepare"
        )
    if not m.get("complete", False):
        raise DataError(f"{where} is marked incomplete. Fix: re-run the same prepare command to finish it")
    return m


def read_manifest(directory: str | os.PathLike) -> dict:
    """Read and sanity-check ``manifest.json`` of a prepared directory."""
    d = Path(directory)
    mpath = d / MANIFEST
    if not d.exists():
        raise DataError(
            f"data directory {d} does not exist. Fix: create it with "
            "'python -m data_pipeline.prepare --source FILES --tokenizer DIR --out DIR'"
        )
    if not mpath.is_file():
        if (d / PROGRESS).is_file():
            raise DataError(
                f"{mpath} is missing but {d / PROGRESS} exists: preparation was interrupted. "
                "Fix: re-run the same 'python -m data_pipeline.prepare' command to finish it"
            )
        raise DataError(
            f"{mpath} not found: {d} is not a prepared shard directory. Fix: create it with "
            "'python -m data_pipeline.prepare --source FILES --tokenizer DIR --out DIR'"
        )
    try:
        text = mpath.read_bytes()
    except OSError as e:
        raise DataError(f"{mpath} cannot be read ({e}). Fix: check its permissions") from e
    return parse_manifest(text, str(mpath))


def idx_file_bytes(num_docs: int) -> int:
    """Exact size of a shard's ``.idx`` (an .npy int64 vector of num_docs + 1 offsets)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": (num_docs + 1,)})
    return len(buf.getvalue()) + 8 * (num_docs + 1)


FIX_SHARDS = (
    "Fix: re-run 'python -m data_pipeline.prepare' into a fresh --out directory (or restore the file from a good copy)"
)


def _check_sizes(d: Path, manifest: dict) -> list[tuple[str, int, int]]:
    """Existence and exact byte size of every .bin/.idx; returns (file, size, mtime_ns) of each."""
    dtype = np.dtype(manifest["dtype"])
    state = []
    for s in manifest["shards"]:
        for ext, want in (("bin", s["num_tokens"] * dtype.itemsize), ("idx", idx_file_bytes(s["num_docs"]))):
            p = d / f"{s['name']}.{ext}"
            try:
                st = p.stat()
            except FileNotFoundError:
                raise DataError(f"shard file {p} listed in {d / MANIFEST} is missing. {FIX_SHARDS}") from None
            if st.st_size != want:
                what = (
                    f"the manifest says {s['num_tokens']} tokens ({want} bytes)"
                    if ext == "bin"
                    else f"{s['num_docs']} documents need {want} bytes"
                )
                raise DataError(
                    f"shard {p} has {st.st_size} bytes but {what}: the file is truncated or was "
                    f"overwritten. {FIX_SHARDS}"
                )
            state.append((p.name, st.st_size, st.st_mtime_ns))
    return state


def check_token_range(path: Path, dtype: np.dtype, vocab: int, where: str) -> None:
    """Every id in the shard file ``path`` is < vocab (else it was made with another tokenizer)."""
    arr = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
    step = 1 << 24
    for a in range(0, len(arr), step):
        mx = int(arr[a : a + step].max())
        if mx >= vocab:
            raise DataError(
                f"shard {where} contains token id {mx} >= vocab_size {vocab} from its manifest: "
                f"it was made with a different tokenizer. {FIX_SHARDS}"
            )
    del arr


def _verify_contents(d: Path, manifest: dict) -> None:
    dtype, vocab = np.dtype(manifest["dtype"]), int(manifest["vocab_size"])
    for s in manifest["shards"]:
        bin_path, idx_path = d / f"{s['name']}.bin", d / f"{s['name']}.idx"
        if file_sha256(bin_path).hexdigest() != s["sha256"]:
            raise DataError(
                f"shard {bin_path} fails its sha256 check against {d / MANIFEST} (corrupted bytes). {FIX_SHARDS}"
            )
        if "idx_sha256" in s and file_sha256(idx_path).hexdigest() != s["idx_sha256"]:
            raise DataError(f"document index {idx_path} fails its sha256 check against {d / MANIFEST}. {FIX_SHARDS}")
        check_token_range(bin_path, dtype, vocab, str(bin_path))
        check_offsets(np.load(idx_path, mmap_mode="r"), s, str(idx_path))


def check_offsets(offs: np.ndarray, shard: dict, where: str) -> None:
    if len(offs) != shard["num_docs"] + 1 or (
        len(offs) and (int(offs[0]) != 0 or int(offs[-1]) != shard["num_tokens"])
    ):
        raise DataError(f"document index {where} does not match {shard['name']}.bin and the manifest. {FIX_SHARDS}")


# ---- a record of what was verified, so a run hashes its data once -------------------------

VERIFY_RECORD = "data_verified.json"


def verification_key(d: Path, manifest_sha: str, state: list) -> str:
    """Identity of "this manifest over exactly these files" (names, sizes, mtimes)."""
    blob = json.dumps([str(Path(d).resolve()), manifest_sha, state], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _read_record(path: Path) -> dict:
    try:
        rec = json.loads(path.read_text())
        return rec["verified"] if isinstance(rec, dict) and isinstance(rec.get("verified"), dict) else {}
    except (OSError, ValueError, KeyError):
        return {}


@contextmanager
def file_lock(path: Path, blocking: bool = True):
    """An exclusive ``flock`` on ``path`` (created if needed); yields False if not blocking and busy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def verify_shards(
    directory: str | os.PathLike,
    manifest: dict,
    *,
    mode: str = "full",
    record_dir: str | os.PathLike | None = None,
    manifest_sha: str | None = None,
) -> str:
    """Check every shard against the manifest; return ``"size"``, ``"hashed"`` or ``"recorded"``.

    Always (cheap, every rank): each .bin/.idx exists with its exact byte size. With
    ``mode='full'`` also sha256, token ids < vocab and document offsets, unless
    ``record_dir/data_verified.json`` records this manifest over exactly these files (names, sizes,
    mtimes); the ranks sharing ``record_dir`` take a lock there, so one hashes and the others read
    its record (docs/TRAINING.md, "Verification").
    """
    d = Path(directory)
    state = _check_sizes(d, manifest)
    if mode != "full":
        return "size"
    if record_dir is None:
        _verify_contents(d, manifest)
        return "hashed"
    if manifest_sha is None:
        manifest_sha = hashlib.sha256((d / MANIFEST).read_bytes()).hexdigest()
    record_dir = Path(record_dir)
    record = record_dir / VERIFY_RECORD
    key = verification_key(d, manifest_sha, state)
    if key in _read_record(record):
        return "recorded"
    with file_lock(record_dir / f".{VERIFY_RECORD}.lock"):
        if key in _read_record(record):  # another rank finished while we waited
            return "recorded"
        _verify_contents(d, manifest)
        entries = _read_record(record)
        entries[key] = {
            "source": str(d.resolve()),
            "manifest_sha256": manifest_sha,
            "shards": len(manifest["shards"]),
            "bytes": sum(sz for _, sz, _ in state),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        atomic_write(record, json.dumps({"version": 1, "verified": entries}, indent=1, sort_keys=True) + "\n")
    return "hashed"


class ShardSet:
    """One prepared directory viewed as a single memory-mapped token stream.

    ``read(a, b)`` returns tokens ``[a, b)`` of the concatenation of all shards (in manifest
    order); ``gather(starts, n)`` the windows ``[a, a + n)`` for an array of starts at once
    (numpy fancy indexing over each shard's map, no per-row Python); ``doc_ids`` /
    ``gather_doc_ids`` the global document index of those positions. Shards are opened lazily,
    so only the pages actually read are ever resident.

    A mapped shard is re-checked (``stat``: size, inode, mtime) each time a read touches it, so
    a shard truncated or replaced under a live run is a DataError naming the file, not a SIGBUS
    (except in the microseconds between that check and the copy).
    """

    def __init__(self, directory: str | os.PathLike, manifest: dict | None = None):
        self.dir = Path(directory)
        self.where = str(self.dir)
        self.manifest = manifest or read_manifest(self.dir)
        self._init_index()
        self._opened: dict[int, os.stat_result] = {}

    def _init_index(self) -> None:
        self.dtype = np.dtype(self.manifest["dtype"])
        shards = self.manifest["shards"]
        self.names = [s["name"] for s in shards]
        self.tok_starts = np.cumsum([0] + [s["num_tokens"] for s in shards], dtype=np.int64)
        self.doc_starts = np.cumsum([0] + [s["num_docs"] for s in shards], dtype=np.int64)
        self.num_tokens = int(self.tok_starts[-1])
        self._bins: dict[int, np.ndarray] = {}
        self._idx: dict[int, np.ndarray] = {}

    # -- storage: a local file per shard (RemoteShardSet overrides these) ----------------------
    def _path(self, i: int, ext: str = "bin") -> Path:
        return self.dir / f"{self.names[i]}.{ext}"

    def _check_live(self, i: int) -> None:
        """Shard i is still the file mapped: present, of the manifest's size, with the same inode and mtime."""
        p = self._path(i)
        want = int(self.manifest["shards"][i]["num_tokens"]) * self.dtype.itemsize
        old = self._opened.get(i)
        try:
            st = p.stat()
        except FileNotFoundError:
            why = "is gone"
        else:
            if st.st_size != want:
                why = f"has {st.st_size} bytes but the manifest says {want} (truncated or overwritten)"
            elif old is not None and (st.st_ino, st.st_mtime_ns) != (old.st_ino, old.st_mtime_ns):
                why = "was replaced or modified (inode or mtime changed) while this run was reading it"
            else:
                return
        raise DataError(f"shard {p} {why}. {FIX_SHARDS}, then resume from the last checkpoint")

    def _bin(self, i: int) -> np.ndarray:
        self._check_live(i)  # size first: never map a short file
        a = self._bins.get(i)
        if a is None:
            p = self._path(i)
            self._opened[i] = p.stat()
            a = self._bins[i] = (
                np.memmap(p, dtype=self.dtype, mode="r") if self._opened[i].st_size else np.zeros(0, self.dtype)
            )
        return a

    def _offsets(self, i: int) -> np.ndarray:
        a = self._idx.get(i)
        if a is None:
            p = self._path(i, "idx")
            try:
                a = np.load(p, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise DataError(f"document index {p} cannot be read ({e}). {FIX_SHARDS}") from e
            check_offsets(a, self.manifest["shards"][i], str(p))
            self._idx[i] = a
        return a

    def _slice(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of shard i, in the shard's dtype."""
        return self._bin(i)[lo:hi]

    def _rows(self, i: int, los: np.ndarray, n: int) -> np.ndarray:
        """Tokens [lo, lo + n) of shard i for every lo (all inside the shard): shape (len(los), n)."""
        return np.lib.stride_tricks.sliding_window_view(self._bin(i), n)[los]

    # -- reading ---------------------------------------------------------------------------------
    def _pieces(self, a: int, b: int):
        s = int(np.searchsorted(self.tok_starts, a, side="right")) - 1
        while a < b:
            lo = a - int(self.tok_starts[s])
            hi = min(b, int(self.tok_starts[s + 1])) - int(self.tok_starts[s])
            yield s, lo, hi
            a = int(self.tok_starts[s]) + hi
            s += 1

    def read(self, a: int, b: int) -> np.ndarray:
        parts = [self._slice(s, lo, hi) for s, lo, hi in self._pieces(a, b)]
        return parts[0].astype(np.int64) if len(parts) == 1 else np.concatenate(parts).astype(np.int64)

    def doc_ids(self, a: int, b: int) -> np.ndarray:
        parts = []
        for s, lo, hi in self._pieces(a, b):
            offs = self._offsets(s)
            pos = np.arange(lo, hi, dtype=np.int64)
            parts.append(np.searchsorted(offs, pos, side="right") - 1 + self.doc_starts[s])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _groups(self, starts: np.ndarray, n: int):
        """(shard, rows) for windows inside one shard, then the rows that cross a shard boundary."""
        if len(starts) and (starts.min() < 0 or starts.max() + n > self.num_tokens):
            raise IndexError(f"windows of {n} tokens at {starts.min()}..{starts.max()} exceed {self.num_tokens} tokens")
        shard = np.searchsorted(self.tok_starts, starts, side="right") - 1
        inside = starts + n <= self.tok_starts[np.minimum(shard + 1, len(self.names))]
        groups = [(int(s), np.flatnonzero(inside & (shard == s))) for s in np.unique(shard[inside])]
        return groups, np.flatnonzero(~inside)

    def gather(self, starts, n: int) -> np.ndarray:
        """Tokens ``[a, a + n)`` for each start a, shape (len(starts), n), in the shards' dtype."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), n), dtype=self.dtype)
        groups, crossing = self._groups(starts, n)
        for s, rows in groups:
            out[rows] = self._rows(s, starts[rows] - self.tok_starts[s], n)
        for r in crossing:
            out[r] = self.read(int(starts[r]), int(starts[r]) + n)
        return out

    def gather_doc_ids(self, starts, n: int, relative: bool = False) -> np.ndarray:
        """Global document index of each position of ``gather(starts, n)`` (int64); with
        ``relative``, counted from each window's first document (0 at its first position).

        Per window: the offsets inside it mark where a new document starts, and a cumulative
        sum along the row numbers them; no search per position.
        """
        starts = np.asarray(starts, dtype=np.int64)
        out = np.zeros((len(starts), n), dtype=np.int64)
        groups, crossing = self._groups(starts, n)
        for s, rows in groups:
            offs = self._offsets(s)
            lo = starts[rows] - self.tok_starts[s]
            first = np.searchsorted(offs, lo, side="right")  # offsets <= lo: doc of lo is first - 1
            last = np.searchsorted(offs, lo + n - 1, side="right")  # offsets <= the window's last position
            k = last - first  # document starts inside the window
            if k.any():
                r = np.repeat(np.arange(len(rows)), k)
                j = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k) + np.repeat(first, k)
                marks = np.zeros((len(rows), n), dtype=np.int64)
                np.add.at(marks, (r, np.asarray(offs[j], dtype=np.int64) - lo[r]), 1)
                block = np.cumsum(marks, axis=1)
            else:
                block = np.zeros((len(rows), n), dtype=np.int64)
            if not relative:
                block += (first - 1 + self.doc_starts[s])[:, None]
            out[rows] = block
        for r in crossing:
            d = self.doc_ids(int(starts[r]), int(starts[r]) + n)
            out[r] = d - d[0] if relative else d
        return out
