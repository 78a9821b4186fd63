"""Shards in object storage or behind HTTP: range reads through fsspec, retries, a per-node cache.

Why: a cluster keeps its tokenized corpus in S3/GCS/R2/HTTP(S)/the HF Hub, not on every node.
``RemoteShardSet`` reads the same prepared directory (manifest.json + shard_*.bin/.idx) from
any fsspec URL and yields byte-for-byte the tokens a local ``ShardSet`` yields, so the global
order, the loader state and a resume are the same whichever storage holds the shards. How blocks
are read, cached, verified and retried: docs/TRAINING.md, "How remote shards are read and cached".
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from common.errors import DataError

from .shards import (
    FIX_SHARDS,
    MANIFEST,
    ShardSet,
    check_offsets,
    check_token_range,
    file_lock,
    parse_manifest,
    read_manifest,
)

CACHE_ENV = "DATA_PIPELINE_CACHE_DIR"
_SCHEMES_LOCAL = ("file://", "local://")


def is_remote(location: str | os.PathLike) -> bool:
    """True for an fsspec URL other than a local file (``s3://``, ``gs://``, ``https://``, ``hf://`` ...)."""
    s = str(location)
    return "://" in s and not s.startswith(_SCHEMES_LOCAL)


def local_path(location: str | os.PathLike) -> str:
    s = str(location)
    for p in _SCHEMES_LOCAL:
        if s.startswith(p):
            return s[len(p) :]
    return s


def _touch(path: Path) -> None:
    """Mark a cache file as recently used (eviction goes by mtime); it may have been evicted meanwhile."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(path)


def default_cache_dir() -> Path:
    """$DATA_PIPELINE_CACHE_DIR, else a per-user folder in the node-local temp directory."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path(tempfile.gettempdir()) / f"data_pipeline_cache-{os.getuid()}"


class RemoteStore:
    """Byte access to the files of one remote directory, with retries and exact-length checks."""

    def __init__(self, url: str, storage_options: dict | None = None, retries: int = 5, backoff_s: float = 1.0):
        import fsspec  # deferred: fsspec backends (s3fs, aiohttp) are heavy

        self.url = str(url).rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            scheme = self.url.split("://", 1)[0]
            raise DataError(
                f"cannot open {self.url}: {e}. Fix: install the fsspec backend for {scheme}:// "
                "(s3fs for s3://, gcsfs for gs://, aiohttp for http(s)://) or correct the URL"
            ) from e
        self.root = self.root.rstrip("/")
        self.retries, self.backoff_s = int(retries), float(backoff_s)

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _fatal(self, name: str, e: BaseException) -> DataError | None:
        """A DataError for failures that retrying cannot fix (missing file, refused credentials)."""
        cause = e.__cause__
        if isinstance(e, FileNotFoundError) and cause is not None and not isinstance(cause, FileNotFoundError):
            return None  # fsspec's HTTP info() reports any failure, a refused connection too, as not found
        if isinstance(e, FileNotFoundError):
            return DataError(
                f"{self.url_of(name)} was not found on the server. Fix: upload the whole prepared directory "
                f"(manifest.json and every shard_*.bin/.idx) to {self.url}, or fix data.source"
            )
        status = getattr(e, "status", None)  # an HTTP answer (aiohttp's ClientResponseError)
        if (
            isinstance(e, PermissionError)
            or type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError")
            or status in (401, 403)
        ):
            return DataError(
                f"access to {self.url_of(name)} was refused ({e}); check the credentials in "
                "data.storage_options or the environment, and the server's permissions"
            )
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
            return DataError(
                f"{self.url_of(name)}: the server answered {status} ({e}); retrying cannot help. "
                "Fix: check the URL and the server's configuration"
            )
        return None

    def _gave_up(self, name: str, what: str, t0: float, e: BaseException) -> DataError:
        return DataError(
            f"cannot read {self.url_of(name)} ({what}) after {self.retries + 1} attempts over "
            f"{time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}. Fix: check that the server is up and "
            "reachable from this node, then resume from the last checkpoint (--resume auto); raise "
            "data.retries / data.retry_backoff_s to ride out longer outages"
        )

    def _retrying(self, what: str, name: str, attempt_fn):
        """Run ``attempt_fn`` until it succeeds, backing off 1x, 2x, 4x ... ``backoff_s``."""
        t0 = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                return attempt_fn()
            except DataError:
                raise
            except Exception as e:  # noqa: BLE001 - any transport error is retried, then reported
                fatal = self._fatal(name, e)
                if fatal is not None:
                    raise fatal from e
                if attempt == self.retries:
                    raise self._gave_up(name, what, t0, e) from e
                time.sleep(min(self.backoff_s * 2**attempt, 60.0))
        raise AssertionError("unreachable")

    def read_bytes(self, name: str) -> bytes:
        return self._retrying("whole file", name, lambda: self.fs.cat_file(self._path(name)))

    def size(self, name: str) -> int | None:
        return self._retrying("size", name, lambda: self.fs.info(self._path(name)).get("size"))

    def read_ranges(self, reqs: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes [start, end) of each (name, start, end), fetched concurrently; exactly end - start each."""
        out: list[bytes | None] = [None] * len(reqs)
        pending = list(range(len(reqs)))
        t0 = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                got = self.fs.cat_ranges(
                    [self._path(reqs[i][0]) for i in pending],
                    [reqs[i][1] for i in pending],
                    [reqs[i][2] for i in pending],
                    on_error="return",
                )
            except Exception as e:  # noqa: BLE001 - e.g. the whole batch failed to connect
                got = [e] * len(pending)
            failed = []
            for i, r in zip(pending, got):
                name, a, b = reqs[i]
                if isinstance(r, BaseException):
                    fatal = self._fatal(name, r)
                    if fatal is not None:
                        raise fatal from r
                    failed.append((i, r))
                    continue
                if len(r) != b - a:
                    if len(r) > b - a:
                        raise DataError(
                            f"{self.url_of(name)}: a request for bytes [{a}, {b}) returned {len(r)} bytes; "
                            "the server ignores HTTP Range requests. Fix: serve the shards from a server "
                            "that supports them (nginx, S3, GCS ...)"
                        )
                    raise DataError(
                        f"{self.url_of(name)}: bytes [{a}, {b}) returned only {len(r)} bytes; the remote "
                        f"file is shorter than its manifest says (truncated or replaced). {FIX_SHARDS}"
                    )
                out[i] = bytes(r)
            if not failed:
                return out  # type: ignore[return-value]
            if attempt == self.retries:
                i, e = failed[0]
                name, a, b = reqs[i]
                raise self._gave_up(name, f"bytes [{a}, {b})", t0, e) from e
            time.sleep(min(self.backoff_s * 2**attempt, 60.0))
            pending = [i for i, _ in failed]
        raise AssertionError("unreachable")


class ShardCache:
    """Node-local files under ``root/<namespace>/``: ``blocks/<shard>/<n>``, ``whole/<shard>.bin``, ``idx/``.

    Safe for many processes at once: every file is written under a unique temporary name and
    renamed into place; a reader that loses a file to eviction fetches it again. After every
    ``max_bytes / 16`` a process writes, one process evicts (so the bound can be overshot by 1/16
    per writing process between checks).
    """

    def __init__(self, root: str | os.PathLike, namespace: str, max_bytes: int):
        self.root = Path(root)
        self.dir = self.root / namespace
        self.max_bytes = int(max_bytes)
        self._written = 0
        try:
            for sub in ("blocks", "whole", "idx"):
                (self.dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(
                f"cannot create the shard cache in {self.dir} ({e}). Fix: set data.cache_dir (or "
                f"${CACHE_ENV}) to a writable node-local directory"
            ) from e

    def block_path(self, name: str, b: int) -> Path:
        return self.dir / "blocks" / name / f"{b:07d}"

    def whole_path(self, name: str) -> Path:
        return self.dir / "whole" / f"{name}.bin"

    def idx_path(self, name: str) -> Path:
        return self.dir / "idx" / f"{name}.idx"

    def get(self, path: Path, size: int | None = None) -> bytes | None:
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if size is not None and len(data) != size:  # not ours (renames are atomic): drop it
            path.unlink(missing_ok=True)
            return None
        _touch(path)
        return data

    def put(self, path: Path, data: bytes) -> None:
        for attempt in range(3):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, path)
                break
            except FileNotFoundError:
                # another process promoted this shard to a whole file and dropped its blocks' directory
                # between our mkdir and our write: make it again
                tmp.unlink(missing_ok=True)
                if attempt == 2:
                    raise
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise DataError(
                    f"cannot write the shard cache file {path} ({e}). Fix: free space there, lower "
                    "data.cache_max_gb, or point data.cache_dir at another node-local disk"
                ) from e
        self._written += len(data)
        if self._written > self.max_bytes // 16:
            self.evict()

    def count_blocks(self, name: str) -> int:
        try:
            return sum(1 for e in os.scandir(self.dir / "blocks" / name) if not e.name.endswith(".tmp"))
        except FileNotFoundError:
            return 0

    def drop_blocks(self, name: str) -> None:
        shutil.rmtree(self.dir / "blocks" / name, ignore_errors=True)

    def evict(self) -> None:
        """Delete least recently used files until the cache holds <= 90% of max_bytes."""
        self._written = 0
        with file_lock(self.root / ".evict.lock", blocking=False) as got:
            if not got:
                return
            files, total, now = [], 0, time.time()
            for dirpath, _, names in os.walk(self.root):
                for n in names:
                    if n.endswith(".lock"):
                        continue
                    p = os.path.join(dirpath, n)
                    try:
                        st = os.stat(p)
                    except FileNotFoundError:
                        continue
                    if n.endswith(".tmp") and now - st.st_mtime < 600:  # someone is writing it
                        continue
                    files.append((st.st_mtime, st.st_size, p))
                    total += st.st_size
            if total <= self.max_bytes:
                return
            for _, size, p in sorted(files):
                if total <= 0.9 * self.max_bytes:
                    break
                try:
                    os.unlink(p)
                    total -= size
                except FileNotFoundError:
                    pass


class RemoteShardSet(ShardSet):
    """A prepared directory at an fsspec URL, read by range through a `ShardCache` (see module doc).

    Same interface and the same bytes as `ShardSet`. One instance is meant for one thread.
    """

    MEMORY_BLOCKS_BYTES = 32 << 20  # recently used blocks kept in memory, per instance

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_max_bytes: int = 20 << 30,
        block_bytes: int = 1 << 20,
        retries: int = 5,
        backoff_s: float = 1.0,
        manifest_bytes: bytes | None = None,
    ):
        self.store = RemoteStore(url, storage_options, retries, backoff_s)
        self.url = self.where = self.dir = self.store.url
        text = manifest_bytes if manifest_bytes is not None else self.store.read_bytes(MANIFEST)
        self.manifest = parse_manifest(text, self.store.url_of(MANIFEST))
        self.manifest_sha256 = hashlib.sha256(text).hexdigest()
        self._init_index()
        self.block_bytes = int(block_bytes)
        if self.block_bytes < 1:
            raise DataError(f"data.cache_block_kb must be positive, got block size {block_bytes} bytes")
        ns = hashlib.sha256(f"{self.url}\n{self.manifest_sha256}".encode()).hexdigest()[:20]
        self.cache = ShardCache(cache_dir or default_cache_dir(), ns, cache_max_bytes)
        self._sized: set[int] = set()
        self._mem: OrderedDict = OrderedDict()
        self._mem_bytes = 0

    # -- geometry ------------------------------------------------------------------------------
    def _nbytes(self, i: int) -> int:
        return int(self.manifest["shards"][i]["num_tokens"]) * self.dtype.itemsize

    def _nblocks(self, i: int) -> int:
        return -(-self._nbytes(i) // self.block_bytes)

    def _block_len(self, i: int, b: int) -> int:
        return min(self.block_bytes, self._nbytes(i) - b * self.block_bytes)

    # -- whole cached shards: memory-mapped, like local ones -------------------------------------
    def _bin(self, i: int) -> np.ndarray | None:
        """The whole shard from the cache, or None. (No `_check_live`: cache files are only ever renamed
        into place after their sha256 check.)"""
        a = self._bins.get(i)
        if a is None:
            p = self.cache.whole_path(self.names[i])
            try:
                st = p.stat()
            except FileNotFoundError:
                return None
            if st.st_size != self._nbytes(i):
                return None
            _touch(p)
            a = self._bins[i] = np.memmap(p, dtype=self.dtype, mode="r") if st.st_size else np.zeros(0, self.dtype)
        return a

    def _promote(self, i: int) -> None:
        """All blocks of shard i are cached: join them, check sha256 and token ids, keep the whole file."""
        name = self.names[i]
        whole = self.cache.whole_path(name)
        with file_lock(self.cache.dir / "locks" / f"{name}.lock", blocking=False) as got:
            if not got or whole.exists():
                return
            tmp = whole.with_name(f"{whole.name}.{os.getpid()}.tmp")
            h = hashlib.sha256()
            try:
                with open(tmp, "wb") as f:
                    for b in range(self._nblocks(i)):
                        data = self._cached_block(i, b)
                        if data is None:  # evicted meanwhile: try again later
                            return
                        h.update(data)
                        f.write(data)
                if h.hexdigest() != self.manifest["shards"][i]["sha256"]:
                    self.cache.drop_blocks(name)
                    self._mem.clear()
                    self._mem_bytes = 0
                    raise DataError(
                        f"shard {self.store.url_of(name + '.bin')} fails its sha256 check against "
                        f"{self.store.url_of(MANIFEST)}: the remote file differs from the one prepared "
                        f"(corrupted or replaced). {FIX_SHARDS}"
                    )
                check_token_range(tmp, self.dtype, int(self.manifest["vocab_size"]), self.store.url_of(name + ".bin"))
                os.replace(tmp, whole)
            finally:
                tmp.unlink(missing_ok=True)
        self.cache.drop_blocks(name)

    # -- blocks ------------------------------------------------------------------------------
    def _remember(self, key, data: bytes) -> None:
        self._mem[key] = data
        self._mem_bytes += len(data)
        limit = min(self.MEMORY_BLOCKS_BYTES, self.cache.max_bytes)  # memory counts as cache too
        while self._mem_bytes > limit and self._mem:
            _, old = self._mem.popitem(last=False)
            self._mem_bytes -= len(old)

    def _cached_block(self, i: int, b: int) -> bytes | None:
        """Block b of shard i from memory or the node's cache; None where neither holds it."""
        key = (i, b)
        data = self._mem.get(key)
        if data is not None:
            self._mem.move_to_end(key)
            return data
        data = self.cache.get(self.cache.block_path(self.names[i], b), self._block_len(i, b))
        if data is not None:
            self._remember(key, data)
        return data

    def _check_size(self, i: int) -> None:
        if i in self._sized:
            return
        name = self.names[i] + ".bin"
        size = self.store.size(name)
        if size is not None and size != self._nbytes(i):
            raise DataError(
                f"shard {self.store.url_of(name)} has {size} bytes but {self.store.url_of(MANIFEST)} "
                f"says {self.manifest['shards'][i]['num_tokens']} tokens ({self._nbytes(i)} bytes): the "
                f"remote file is truncated or was replaced. {FIX_SHARDS}"
            )
        self._sized.add(i)

    def _blocks(self, i: int, needed) -> dict[int, bytes]:
        """Blocks `needed` of shard i: from memory or the node's cache, the rest in one ranged read."""
        have = {b: self._cached_block(i, b) for b in needed}
        missing = [b for b, data in have.items() if data is None]
        if missing:
            self._check_size(i)
            name, B = self.names[i], self.block_bytes
            reqs = [(name + ".bin", b * B, b * B + self._block_len(i, b)) for b in missing]
            for b, data in zip(missing, self.store.read_ranges(reqs)):
                self.cache.put(self.cache.block_path(name, b), data)
                have[b] = data
            if self.cache.count_blocks(name) >= self._nblocks(i):
                self._promote(i)
            for b in missing:
                self._remember((i, b), have[b])
        return have

    def _span(self, blocks: dict[int, bytes], a: int, b: int) -> np.ndarray:
        """Bytes [a, b) of a shard from its blocks, as tokens."""
        B = self.block_bytes
        first, last = a // B, (b - 1) // B
        raw = b"".join(blocks[k] for k in range(first, last + 1))[a - first * B : b - first * B]
        return np.frombuffer(raw, dtype=self.dtype)

    def _slice(self, i: int, lo: int, hi: int) -> np.ndarray:
        return self._rows(i, np.array([lo]), hi - lo)[0] if hi > lo else np.zeros(0, self.dtype)

    def _rows(self, i: int, los: np.ndarray, n: int) -> np.ndarray:
        arr = self._bin(i)
        if arr is not None:
            return np.lib.stride_tricks.sliding_window_view(arr, n)[los]
        isz, B = self.dtype.itemsize, self.block_bytes
        a, b = los * isz, (los + n) * isz
        needed = sorted({k for x, y in zip((a // B).tolist(), ((b - 1) // B).tolist()) for k in range(x, y + 1)})
        blocks = self._blocks(i, needed)
        out = np.empty((len(los), n), dtype=self.dtype)
        for r, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
            out[r] = self._span(blocks, x, y)
        return out

    def _offsets(self, i: int) -> np.ndarray:
        a = self._idx.get(i)
        if a is not None:
            return a
        s = self.manifest["shards"][i]
        name = s["name"] + ".idx"
        path = self.cache.idx_path(s["name"])
        data = self.cache.get(path)
        if data is None or ("idx_sha256" in s and hashlib.sha256(data).hexdigest() != s["idx_sha256"]):
            data = self.store.read_bytes(name)
            if "idx_sha256" in s and hashlib.sha256(data).hexdigest() != s["idx_sha256"]:
                raise DataError(
                    f"document index {self.store.url_of(name)} fails its sha256 check against "
                    f"{self.store.url_of(MANIFEST)}. {FIX_SHARDS}"
                )
            self.cache.put(path, data)
        try:
            a = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as e:
            raise DataError(
                f"document index {self.store.url_of(name)} is not a valid .npy file ({e}). {FIX_SHARDS}"
            ) from e
        check_offsets(a, s, self.store.url_of(name))
        self._idx[i] = a
        return a


def open_shards(location: str | os.PathLike, **remote) -> ShardSet:
    """A `ShardSet` for a local directory or a `RemoteShardSet` for an fsspec URL.

    ``remote`` (ignored for local paths): storage_options, cache_dir, cache_max_bytes,
    block_bytes, retries, backoff_s.
    """
    if is_remote(location):
        return RemoteShardSet(str(location), **remote)
    path = local_path(location)
    return ShardSet(path, read_manifest(path))
