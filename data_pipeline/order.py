"""Deterministic global order: O(1)-memory shuffles and an exact weighted interleave.

Why: sequence k of epoch e must be a pure function of (seed, e, k) so that any rank can
compute its share of any global batch without communication, a resume needs only the
global position, and a changed world size continues the same order. `Permutation` and
`MixtureSchedule` are stateless and vectorised over numpy arrays of indices; `RankShare` walks a
rank through its share of the global batches, its one state the global position.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from common.errors import DataError

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def derive_key(*parts) -> int:
    """A 64-bit key from any tuple of ints/strings (stable across processes and machines)."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A pseudo-random bijection of ``[0, n)``: a 6-round Feistel network with cycle walking.

    Memory is O(1) in ``n`` (no index array), so a corpus of billions of sequences is
    shuffled as cheaply as a small one; ``perm(i)`` for any array of i is vectorised.
    """

    ROUNDS = 6

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError("Permutation needs n >= 1")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = [np.uint64(derive_key(key, r)) for r in range(self.ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, idx) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"permutation index out of range [0, {self.n})")
        y = self._feistel(idx.astype(np.uint64))
        bad = y >= np.uint64(self.n)
        while bad.any():  # cycle walking: stays a bijection of [0, n)
            y[bad] = self._feistel(y[bad])
            bad = y >= np.uint64(self.n)
        return y.astype(np.int64)


class MixtureSchedule:
    """Assign global sample k to (component c, index j within c), exactly by weight.

    Nested Beatty sequences: component 0 takes sample r iff floor((r+1)q0+phi0) > floor(r q0+phi0)
    with q0 = w0 / (w0+...), the rest go to the next level with q1 = w1 / (w1+...), and so on.
    After any K samples every component has within +-1 (per level) of ``K * w_c`` samples, the
    local index j is a closed form, and the phases phi come from the seed.
    """

    def __init__(self, weights, key: int):
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
            raise ValueError("weights must be a non-empty list of non-negative numbers with a positive sum")
        self.weights = w / w.sum()
        tails = np.cumsum(self.weights[::-1])[::-1]
        self.q = np.where(tails > 0, self.weights / np.where(tails > 0, tails, 1.0), 1.0)
        self.phi = np.array([(derive_key(key, "phase", i) >> 11) / float(1 << 53) for i in range(len(w))])

    def assign(self, ks) -> tuple[np.ndarray, np.ndarray]:
        ks = np.asarray(ks, dtype=np.int64)
        comp = np.full(ks.shape, len(self.weights) - 1, dtype=np.int64)
        local = ks.copy()
        active = np.ones(ks.shape, dtype=bool)
        for i in range(len(self.weights) - 1):
            r = local[active].astype(np.float64)
            c0 = np.floor(r * self.q[i] + self.phi[i])
            c1 = np.floor((r + 1) * self.q[i] + self.phi[i])
            hit = c1 > c0
            where = np.flatnonzero(active)
            comp[where[hit]] = i
            local[where[hit]] = c0[hit].astype(np.int64)
            local[where[~hit]] = (r[~hit] - c0[~hit]).astype(np.int64)
            active[where[hit]] = False
        return comp, local


class RankShare:
    """Iterator of this rank's share [B // W] of each global batch of B samples (the `text:` and
    `classify:` loaders). The state is the global sample count, so a resume with any world size
    continues the same order; `_batch` turns the global sample indices into tensors, and a state
    of other data (source, seed or fingerprint) is refused."""

    fingerprint: str

    def __init__(self, source: str, seed: int, seq_len: int, global_batch_size: int, dp_rank: int, dp_world_size: int):
        if global_batch_size % dp_world_size:
            raise DataError(f"global batch {global_batch_size} is not divisible by {dp_world_size} data-parallel ranks")
        self.source, self.seed = source, seed
        self.T, self.B, self.rank, self.world = seq_len, global_batch_size, dp_rank, dp_world_size
        self.samples_seen = 0

    def _batch(self, ks: np.ndarray) -> dict:
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        per = self.B // self.world
        start = self.samples_seen + self.rank * per
        batch = self._batch(np.arange(start, start + per, dtype=np.int64))
        self.samples_seen += self.B
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_seen": self.samples_seen,
            "source": self.source,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if (
            d.get("source", self.source) != self.source
            or d.get("seed", self.seed) != self.seed
            or d.get("fingerprint", self.fingerprint) != self.fingerprint
        ):
            raise DataError(
                f"loader state is for source={d.get('source')!r} seed={d.get('seed')} (fingerprint "
                f"{d.get('fingerprint')}), but the recipe has source={self.source!r} seed={self.seed} "
                f"(fingerprint {self.fingerprint}). Fix: resume with the same data settings"
            )
        self.samples_seen = int(d["samples_seen"])
