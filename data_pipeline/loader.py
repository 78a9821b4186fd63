"""The training/validation loader: packed, memory-mapped, deterministic, resumable.

Global order: sample k (counted over the whole run, all ranks together) maps to
``(epoch e = k // N, i = k % N)`` and then to sequence ``perm_{seed,e}(i)``; a rank reads rows
``[r*B/W, (r+1)*B/W)`` of every global batch of B. Nothing depends on W, so world sizes 1, 2
and 4 see the same global batches, and the only state is k (``samples_seen``).

Text (shard) data: the token stream of all shards (each document followed by EOS) is cut
into windows of ``seq_len + 1`` tokens that overlap by one token; window w covers tokens
``[w*L, w*L + L + 1)``; inputs are the first L, labels the last L. The last
``val_fraction`` of the stream is held out; its windows form the validation split, read in
stream order.

Synthetic tasks: one example per row, padded with ``pad_id``; labels are -100 except where
the task's loss mask scores the next token.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from common.constants import IGNORE_INDEX
from common.errors import DataError

from .classification import ClassificationLoader
from .config import ClassifyData, DataConfig, DataSource, TextData
from .foreign import ForeignShards, is_foreign
from .order import MixtureSchedule, Permutation, derive_key
from .shards import ShardSet, read_manifest, verify_shards
from .storage import is_remote, local_path, open_shards
from .synthetic import get_task
from .text import TextLoader
from .tokenizer import load_tokenizer

STATE_VERSION = 1
_VERIFIED: set = set()  # (dir, manifest sha, mode) already verified in this process


def remote_options(cfg: DataConfig) -> dict:
    """Keyword arguments of `open_shards` for a remote source, from the data config."""
    return {
        "storage_options": cfg.storage_options,
        "cache_dir": cfg.cache_dir,
        "cache_max_bytes": int(cfg.cache_max_gb * (1 << 30)),
        "block_bytes": cfg.cache_block_kb << 10,
        "retries": cfg.retries,
        "backoff_s": cfg.retry_backoff_s,
    }


class ShardSource:
    """Fixed-length windows over one prepared directory's (or URL's) train or val region."""

    def __init__(
        self,
        directory: str,
        cfg: DataConfig,
        split: str,
        seq_len: int,
        verify_record: str | os.PathLike | None = None,
        whole: bool = False,
    ):
        if is_foreign(directory):  # megatron:PREFIX or olmo:FILES, read in place (data_pipeline/foreign.py)
            tok = load_tokenizer(cfg.tokenizer).identity if cfg.tokenizer else None
            self.shards = ForeignShards(directory, cfg.vocab_size, cfg.eos_id, cfg.token_dtype, tok)
            self.dir = directory
            manifest, sha = self.shards.manifest, self.shards.fingerprint
        elif is_remote(directory):
            # Remote: manifest first; sizes are checked per shard on first touch and sha256 when a
            # shard is cached whole (hashing at start would download the corpus on every rank).
            self.shards = open_shards(directory, **remote_options(cfg))
            self.dir = self.shards.where
            manifest, sha = self.shards.manifest, self.shards.manifest_sha256
        else:
            self.dir = str(Path(local_path(directory)).resolve())
            manifest = read_manifest(self.dir)
            sha = hashlib.sha256((Path(self.dir) / "manifest.json").read_bytes()).hexdigest()
            key = (self.dir, sha, cfg.verify)
            if key not in _VERIFIED:
                verify_shards(self.dir, manifest, mode=cfg.verify, record_dir=verify_record, manifest_sha=sha)
                _VERIFIED.add(key)
            self.shards = ShardSet(self.dir, manifest)
        self.fingerprint = sha[:16]
        self.tokenizer_id = manifest["tokenizer_id"]
        self.vocab_size = int(manifest["vocab_size"])
        self.eos_id = int(manifest["eos_id"])
        pad = manifest.get("pad_id")
        self.pad_id = self.eos_id if pad is None or pad < 0 else int(pad)
        self.seq_len = seq_len
        total = self.shards.num_tokens
        n_val_tokens = int(total * cfg.val_fraction)
        if whole:  # a named validation set: all of it
            self.start, self.stop = 0, total
        elif split == "train":
            self.start, self.stop = 0, total - n_val_tokens
        else:
            self.start, self.stop = total - n_val_tokens, total
        self.size = max(0, (self.stop - self.start - 1) // seq_len)
        if self.size == 0:
            what = "training" if split == "train" else f"validation (val_fraction={cfg.val_fraction})"
            raise DataError(
                f"{self.dir}: the {'validation set' if whole else what} region has {self.stop - self.start} tokens, "
                f"fewer than seq_len+1 = {seq_len + 1}. Fix: use more data, a shorter seq_len"
                + ("" if split == "train" else " or a larger val_fraction")
            )

    def fetch(self, idx: np.ndarray, want_docs: bool):
        """Rows for window indices ``idx``: one gather per shard touched, no per-row Python."""
        L = self.seq_len
        a = self.start + np.asarray(idx, dtype=np.int64) * L
        toks = self.shards.gather(a, L + 1)
        inp = toks[:, :-1].astype(np.int64)
        lab = toks[:, 1:].astype(np.int64)
        docs = self.shards.gather_doc_ids(a, L, relative=True) if want_docs else None
        return inp, lab, docs


class SyntheticSource:
    """Rows of one synthetic task; finite when the task's split is finite, else unbounded."""

    def __init__(self, cfg: DataConfig, split: str, seq_len: int):
        args = dict(cfg.task_args)
        n_val = int(args.pop("n_val", 512))
        seed = int(args.pop("seed", cfg.seed))
        self.task = get_task(cfg.task_name, seed=seed, **args)
        self.split = "train" if split == "train" else "test"
        size = self.task.size(self.split)
        self.size = size if size is not None else (None if self.split == "train" else n_val)
        if self.task.max_len > seq_len + 1:
            raise DataError(
                f"synthetic:{cfg.task_name} makes sequences of up to {self.task.max_len} tokens but seq_len={seq_len} "
                f"holds {seq_len + 1}. Fix: use seq_len >= {self.task.max_len - 1} or smaller task_args"
            )
        self.seq_len = seq_len
        self.tokenizer_id = self.task.tokenizer_id
        self.vocab_size = self.task.vocab_size
        self.eos_id, self.pad_id = self.task.eos_id, self.task.pad_id
        self.fingerprint = hashlib.sha256(
            json.dumps([self.tokenizer_id, self.task.args, seed, n_val], sort_keys=True).encode()
        ).hexdigest()[:16]

    def fetch(self, idx: np.ndarray, want_docs: bool):
        L = self.seq_len
        n = len(idx)
        inp = np.full((n, L), self.pad_id, dtype=np.int64)
        lab = np.full((n, L), IGNORE_INDEX, dtype=np.int64)
        docs = np.ones((n, L), dtype=np.int64) if want_docs else None
        for row, i in enumerate(idx):
            toks, mask = self.task.sample(int(i), self.split)
            t = np.asarray(toks, dtype=np.int64)
            m = np.asarray(mask, dtype=bool)
            k = len(t) - 1
            inp[row, :k] = t[:-1]
            lab[row, :k] = np.where(m[1:], t[1:], IGNORE_INDEX)
            if want_docs:
                docs[row, :k] = 0
        return inp, lab, docs


class _Prefetcher:
    """One daemon thread that builds the next ``depth`` batches while the caller trains.

    A batch is a pure function of its global position k0, so results are keyed by k0: a jump
    (``load_state_dict``, a rollback) just makes the queued positions stale; nothing about the
    order depends on timing. An exception is re-raised by the ``get`` that waits for its batch.
    Tensors are pinned when CUDA is available, so the host-to-device copy can run asynchronously.
    """

    def __init__(self, make, depth: int, pin: bool):
        # a weak reference: the thread must not keep its loader alive (the loader's __del__ stops it)
        self._make, self._depth, self._pin = weakref.WeakMethod(make), depth, pin
        self._cv = threading.Condition()
        self._want: list[int] = []
        self._done: dict[int, tuple[bool, object]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def get(self, k0: int, step: int):
        with self._cv:
            self._want = [k0 + j * step for j in range(self._depth + 1)]
            # drop stale positions, and failures computed ahead of time (e.g. during an outage that
            # may be over now): those positions are built again, so an error is always a fresh one
            for k in [k for k, (ok, _) in self._done.items() if k not in self._want or not ok]:
                del self._done[k]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="data-prefetch", daemon=True)
                self._thread.start()
            self._cv.notify_all()
            while k0 not in self._done:
                self._cv.wait()
            ok, value = self._done.pop(k0)
            self._want.remove(k0)
        if ok:
            return value
        raise value  # type: ignore[misc]

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return
                    todo = next((k for k in self._want if k not in self._done), None)
                    if todo is not None:
                        break
                    self._cv.wait()
            make = self._make()
            if make is None:
                return
            try:
                batch = make(todo)
                if self._pin:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                res: tuple[bool, object] = (True, batch)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                res = (False, e)
            del make
            with self._cv:
                if todo in self._want:
                    self._done[todo] = res
                self._cv.notify_all()

    def close(self, wait_s: float = 0.0) -> None:
        with self._cv:
            self._closed = True
            self._want, self._done = [], {}
            self._cv.notify_all()
        if wait_s and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait_s)


_LIVE_PREFETCHERS: weakref.WeakSet[_Prefetcher] = weakref.WeakSet()


@atexit.register
def _stop_prefetchers() -> None:
    """Let in-flight batches finish before the interpreter (and torch) is torn down: a daemon
    thread still inside torch at that point can abort the process."""
    for p in list(_LIVE_PREFETCHERS):
        p.close(wait_s=10.0)


class Loader:
    """Iterator of this rank's batches: ``{"input_ids", "labels"[, "doc_ids"]}`` LongTensors.

    ``samples_seen`` counts global sequences; ``state_dict()`` holds only that position (plus
    checks), so it resumes exactly, on any data-parallel world size.
    """

    def __init__(
        self,
        sources: list,
        weights: list[float] | None,
        cfg: DataConfig,
        split: str,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
    ):
        self.sources, self.cfg, self.split, self.seq_len = sources, cfg, split, seq_len
        self.global_batch_size, self.dp_rank, self.dp_world_size = global_batch_size, dp_rank, dp_world_size
        self.local_batch_size = global_batch_size // dp_world_size
        self._samples_seen = 0
        s0 = sources[0]
        self.vocab_size, self.tokenizer_id = s0.vocab_size, s0.tokenizer_id
        self.eos_id, self.pad_id = s0.eos_id, s0.pad_id
        self._sizes = [s.size for s in sources]
        self._mixture = None
        if split == "train" and len(sources) > 1:
            self._mixture = MixtureSchedule(weights, derive_key(cfg.seed, "mixture"))
        self._offsets = None
        if all(n is not None for n in self._sizes):
            self._offsets = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
        self._perms: dict = {}
        self._prefetcher: _Prefetcher | None = None
        fp = [s.fingerprint for s in sources]
        self.fingerprint = hashlib.sha256(json.dumps([fp, weights]).encode()).hexdigest()[:16]

    # -- properties ----------------------------------------------------------------------
    @property
    def samples_seen(self) -> int:
        """Global sequences consumed so far (all ranks together)."""
        return self._samples_seen

    @property
    def num_sequences(self) -> int | None:
        """Sequences per epoch (for a mixture: the sum over components); None if unbounded."""
        return None if any(s is None for s in self._sizes) else int(sum(self._sizes))

    # -- order ----------------------------------------------------------------------------
    def _perm(self, comp: int, epoch: int) -> Permutation:
        key = (comp, epoch)
        p = self._perms.get(key)
        if p is None:
            if len(self._perms) > 8:
                self._perms.clear()
            p = self._perms[key] = Permutation(self._sizes[comp], derive_key(self.cfg.seed, "train", comp, epoch))
        return p

    def _locate(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sample indices -> (source index, sequence index within that source)."""
        if self.split != "train":
            return self._concat_locate(ks)
        if self._mixture is None:
            comp, local = np.zeros_like(ks), ks
        else:
            comp, local = self._mixture.assign(ks)
        seq = np.empty_like(local)
        for c in np.unique(comp):
            sel = comp == c
            n = self._sizes[c]
            if n is None:  # unbounded synthetic stream: every index is fresh
                seq[sel] = local[sel]
                continue
            epochs, within = np.divmod(local[sel], n)
            out = np.empty_like(within)
            for e in np.unique(epochs):
                m = epochs == e
                out[m] = self._perm(int(c), int(e))(within[m])
            seq[sel] = out
        return comp, seq

    def _concat_locate(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream order: all sequences of source 0, then source 1, ... (cycling)."""
        ks = ks % int(self._offsets[-1])
        comp = np.searchsorted(self._offsets, ks, side="right") - 1
        return comp, ks - self._offsets[comp]

    def _fetch(self, comp: np.ndarray, seq: np.ndarray) -> dict:
        want = self.cfg.return_doc_ids
        if len(self.sources) == 1:  # one component: its arrays are the batch
            inp, lab, docs = self.sources[0].fetch(seq, want)
        else:
            inp = np.empty((len(seq), self.seq_len), dtype=np.int64)
            lab = np.empty_like(inp)
            docs = np.empty_like(inp) if want else None
            for c in np.unique(comp):
                rows = np.flatnonzero(comp == c)
                i, l, d = self.sources[int(c)].fetch(seq[rows], want)
                inp[rows], lab[rows] = i, l
                if want:
                    docs[rows] = d
        batch = {"input_ids": torch.from_numpy(inp), "labels": torch.from_numpy(lab)}
        if want:
            batch["doc_ids"] = torch.from_numpy(docs)
        return batch

    def _rank_slice(self, k0: int) -> np.ndarray:
        b = self.local_batch_size
        return np.arange(k0 + self.dp_rank * b, k0 + (self.dp_rank + 1) * b, dtype=np.int64)

    def global_indices(self, k0: int | None = None) -> np.ndarray:
        """(source, sequence) pairs of the global batch starting at sample ``k0`` (for tests/debugging)."""
        k0 = self._samples_seen if k0 is None else k0
        comp, seq = self._locate(np.arange(k0, k0 + self.global_batch_size, dtype=np.int64))
        return np.stack([comp, seq], axis=1)

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self):
        return self

    def _batch_at(self, k0: int) -> dict:
        return self._fetch(*self._locate(self._rank_slice(k0)))

    def __next__(self) -> dict:
        k0 = self._samples_seen
        if self.cfg.prefetch > 0 and self.split == "train":
            if self._prefetcher is None:
                self._prefetcher = _Prefetcher(self._batch_at, self.cfg.prefetch, torch.cuda.is_available())
                _LIVE_PREFETCHERS.add(self._prefetcher)
            batch = self._prefetcher.get(k0, self.global_batch_size)
        else:
            batch = self._batch_at(k0)
        self._samples_seen = k0 + self.global_batch_size
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (it is a daemon; this only frees it early)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def iter_epoch(self):
        """One finite pass over every sequence of this split, in stream order, not shuffled.

        Meant for validation (each val sequence once, same order every time, so losses are
        comparable between steps). The last global batch is filled with padding rows whose
        labels are all -100, so every rank runs the same number of steps. Does not move
        ``samples_seen``.
        """
        total = self.num_sequences
        if total is None:
            raise DataError(f"{self.split} split of {self.cfg.source} is an unbounded stream; it has no finite epoch")
        for k0 in range(0, total, self.global_batch_size):
            ks = self._rank_slice(k0)
            valid = ks < total
            batch = self._fetch(*self._concat_locate(np.minimum(ks, total - 1)))
            if not valid.all():
                bad = torch.from_numpy(~valid)
                batch["input_ids"][bad] = self.pad_id
                batch["labels"][bad] = IGNORE_INDEX
                if "doc_ids" in batch:
                    batch["doc_ids"][bad] = 0
            yield batch

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain ints/strings: the global position plus what it is only valid with."""
        n = self.num_sequences
        k = self._samples_seen
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "samples_seen": int(k),
            "epoch": int(k // n) if n else 0,
            "index_in_epoch": int(k % n) if n else int(k),
            "seed": int(self.cfg.seed),
            "seq_len": int(self.seq_len),
            "source": self.cfg.source,
            "fingerprint": self.fingerprint,
            "tokenizer_id": self.tokenizer_id,
            "global_batch_size": int(self.global_batch_size),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved global position; refuses state from a different stream."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "samples_seen" not in state:
            raise DataError(f"loader state {state!r} was not produced by Loader.state_dict() (version {STATE_VERSION})")
        for key, mine in (
            ("split", self.split),
            ("seed", int(self.cfg.seed)),
            ("seq_len", int(self.seq_len)),
            ("tokenizer_id", self.tokenizer_id),
            ("fingerprint", self.fingerprint),
        ):
            if state.get(key) != mine:
                raise DataError(
                    f"loader state has {key}={state.get(key)!r} but this loader has {mine!r}: the checkpoint was "
                    "made on a different data stream, so its position means nothing here. Fix: use the original data "
                    "config, or start the data from the beginning by not loading the data state"
                )
        self._samples_seen = int(state["samples_seen"])

    def __repr__(self) -> str:
        return (
            f"Loader({self.cfg.source!r}, split={self.split}, seq_len={self.seq_len}, "
            f"batch={self.local_batch_size}x{self.dp_world_size}, vocab={self.vocab_size}, "
            f"samples_seen={self._samples_seen})"
        )


def build_loader(
    cfg: DataSource,
    *,
    split: str,
    seq_len: int,
    global_batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    verify_record: str | os.PathLike | None = None,
) -> Loader:
    """This rank's batch iterator for any data source: each `next()` is its share [B // W, T] of one
    global batch and its state is the GLOBAL number of sequences consumed, so a resume with another
    world size continues the same order. Text and classification sources have their own loaders
    (data_pipeline.text, data_pipeline.classification); shards, mixtures and synthetic tasks a `Loader`.

    ``verify_record``: a directory shared by the run's ranks (e.g. the run directory). With
    ``verify='full'`` the first process there hashes the shards and writes
    ``data_verified.json``; every other rank, and every later start over the same unchanged
    files, only checks sizes (see `shards.verify_shards`).
    """
    if isinstance(cfg, TextData):
        return TextLoader(cfg, split, seq_len, global_batch_size, dp_rank, dp_world_size)
    if isinstance(cfg, ClassifyData):
        return ClassificationLoader(cfg, split, seq_len, global_batch_size, dp_rank, dp_world_size)
    if not isinstance(cfg, DataConfig):
        raise DataError(f"build_loader needs a data source (data_pipeline.config.parse_data), got {type(cfg).__name__}")
    aliases = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "val"}
    if split not in aliases:
        raise DataError(f"build_loader: split must be 'train' or 'val', got {split!r}")
    split = aliases[split]
    for name, v in (("seq_len", seq_len), ("global_batch_size", global_batch_size), ("dp_world_size", dp_world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DataError(f"build_loader: {name} must be an int >= 1, got {v!r}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_world_size:
        raise DataError(f"build_loader: dp_rank must be in [0, {dp_world_size}), got {dp_rank!r}")
    if global_batch_size % dp_world_size:
        raise DataError(
            f"build_loader: global_batch_size {global_batch_size} is not divisible by dp_world_size {dp_world_size}. "
            f"Fix: use a multiple of {dp_world_size} (e.g. {(global_batch_size // dp_world_size + 1) * dp_world_size})"
        )
    if cfg.kind == "synthetic":
        sources, weights = [SyntheticSource(cfg, split, seq_len)], None
    else:
        entries = cfg.mixture if cfg.kind == "mixture" else [{"path": cfg.source, "weight": 1.0}]
        if split == "val" and cfg.val_fraction == 0:
            raise DataError(
                "build_loader(split='val'): DataConfig.val_fraction is 0, so there is no validation split. Fix: set it > 0"
            )
        sources = [ShardSource(e["path"], cfg, split, seq_len, verify_record) for e in entries]
        weights = [e["weight"] for e in entries]
        first = sources[0]
        for s in sources[1:]:
            if (s.tokenizer_id, s.vocab_size) != (first.tokenizer_id, first.vocab_size):
                raise DataError(
                    f"mixture: {s.dir}/manifest.json has tokenizer {s.tokenizer_id} (vocab {s.vocab_size}) but "
                    f"{first.dir}/manifest.json has {first.tokenizer_id} (vocab {first.vocab_size}). "
                    "Fix: prepare every component with the same --tokenizer"
                )
        if cfg.tokenizer is not None:
            tok = load_tokenizer(cfg.tokenizer)
            for s in sources:
                if s.tokenizer_id != tok.identity:
                    raise DataError(
                        f"{s.dir}/manifest.json records tokenizer {s.tokenizer_id} but the training config's tokenizer "
                        f"{tok.path} is {tok.identity}. Fix: re-run prepare with --tokenizer {tok.path}, or set "
                        "data.tokenizer to the tokenizer the shards were made with"
                    )
    if cfg.vocab_size is not None:
        for s in sources:
            if s.vocab_size != cfg.vocab_size:
                where = f"{s.dir}/manifest.json" if isinstance(s, ShardSource) else cfg.source
                raise DataError(
                    f"{where} has vocab_size {s.vocab_size} but the training config says vocab_size={cfg.vocab_size}. "
                    "Fix: set the model's vocab_size to the data's, or re-prepare the data with the matching tokenizer"
                )
    return Loader(sources, weights, cfg, split, seq_len, global_batch_size, dp_rank, dp_world_size)


def build_val_sets(
    cfg: DataSource,
    *,
    seq_len: int,
    global_batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    verify_record: str | os.PathLike | None = None,
    tokenizer_id: str | None = None,
) -> dict[str, Loader] | None:
    """The named validation sets of `data.val_sets` (None when there are none): one loader per set,
    read whole in stream order by `Loader.iter_epoch`. Every set must use `tokenizer_id` (the
    training data's), or the losses would not be of the model's tokens."""
    sets = getattr(cfg, "val_sets", None)
    if not sets:
        return None
    out = {}
    for name, path in sets.items():
        src = ShardSource(path, cfg, "val", seq_len, verify_record, whole=True)
        if tokenizer_id is not None and src.tokenizer_id != tokenizer_id:
            raise DataError(
                f"data.val_sets.{name}: {src.dir}/manifest.json records tokenizer {src.tokenizer_id} but the training "
                f"data uses {tokenizer_id}. Fix: prepare the validation set with the training data's --tokenizer"
            )
        out[name] = Loader([src], None, cfg, "val", seq_len, global_batch_size, dp_rank, dp_world_size)
    return out
