"""Synthetic tasks for the frozen-parts experiments, deterministic from a seed.

Every task has its own small fixed vocabulary (``<pad>`` = 0, ``<eos>`` = 1, then task
symbols), an identity ``synthetic:<task>:v1`` and ``sample(index, split) -> (tokens, loss_mask)``
where ``loss_mask[t] == 1`` marks the positions whose token is scored (the answer).
Example ``i`` of split ``s`` is drawn from ``numpy.random.default_rng([seed, s, i, task])``,
so it is a pure function of its arguments: no state, any order, any number of workers.
Train and test use different split codes (disjoint seed streams) and, for the unbounded
tasks, are also disjoint *by content*: an example whose token hash falls in the test bucket
(1 in ``TEST_BUCKETS``) is only ever a test example, and the train stream redraws it. Short
examples (one kv pair, small sums) would otherwise appear in both. Modular addition uses a
fixed 95/5 split of all pairs; memorization's test set is its train set by definition.

Defaults are sized so a 2-layer transformer of width 64-128 learns them on CPU within a
few thousand steps with ``seq_len`` around 64.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from common.constants import DEFAULT_SEED
from common.errors import DataError

SPLIT_CODES = {"train": 0, "test": 1, "val": 1, "validation": 1}
PAD, EOS = "<pad>", "<eos>"
TEST_BUCKETS = 20
# A finite split of at most this many examples keeps each example after its first draw: a run passes
# over a finite set thousands of times, and a draw (a fresh RNG per example, ~15 us) is most of a
# tiny model's step. 2^17 short examples are a few tens of MB at most.
CACHED_SPLIT_MAX = 1 << 17


def _is_test_example(words: list[str]) -> bool:
    h = hashlib.blake2b(" ".join(words).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % TEST_BUCKETS == 0


def _name_code(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


class Task:
    """Base class: vocabulary handling, argument checking and the per-example RNG."""

    name = "task"
    version = "v1"
    DEFAULTS: dict = {}
    train_size: int | None = None  # None = an unbounded stream of fresh examples
    test_size: int | None = None
    word_sep = " "
    score_eos = False  # the stop token is part of the answer

    def __init__(self, seed: int = DEFAULT_SEED, **args):
        unknown = set(args) - set(self.DEFAULTS)
        if unknown:
            raise DataError(
                f"synthetic task {self.name!r}: unknown task_args {sorted(unknown)}; valid: {sorted(self.DEFAULTS)}"
            )
        self.args = {**self.DEFAULTS, **args}
        self.seed = int(seed)
        for k, v in self.args.items():
            setattr(self, k, v)
        self.symbols = [PAD, EOS] + self.build_symbols()
        self.ids = {s: i for i, s in enumerate(self.symbols)}
        if len(self.ids) != len(self.symbols):
            raise AssertionError(f"{self.name}: duplicate symbols")
        self.pad_id, self.eos_id = 0, 1
        self.check()
        self._drawn: dict[tuple[str, int], tuple[list[int], list[int]]] = {}

    # -- to override ---------------------------------------------------------------------
    def build_symbols(self) -> list[str]:
        raise NotImplementedError

    def check(self) -> None:
        pass

    def generate(self, rng: np.random.Generator, index: int, split: str) -> tuple[list[str], list[int]]:
        raise NotImplementedError

    @property
    def max_len(self) -> int:
        raise NotImplementedError

    # -- public ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def tokenizer_id(self) -> str:
        return f"synthetic:{self.name}:{self.version}"

    def size(self, split: str) -> int | None:
        return self.train_size if self._split(split) == "train" else self.test_size

    def _split(self, split: str) -> str:
        if split not in SPLIT_CODES:
            raise DataError(f"synthetic task {self.name!r}: split must be 'train' or 'test'/'val', got {split!r}")
        return "train" if split == "train" else "test"

    def sample(self, index: int, split: str = "train") -> tuple[list[int], list[int]]:
        """Example ``index`` of ``split`` as (token ids, loss mask); ends with ``<eos>``."""
        split = self._split(split)
        n = self.size(split)
        index = int(index)
        if index < 0 or (n is not None and index >= n):
            raise IndexError(f"synthetic task {self.name!r}: index {index} out of range for split {split!r} (size {n})")
        cached = n is not None and n <= CACHED_SPLIT_MAX
        hit = self._drawn.get((split, index)) if cached else None
        if hit is None:
            hit = self._draw(index, split, n)
            if cached:
                self._drawn[(split, index)] = hit
        return list(hit[0]), list(hit[1])  # copies: a caller may edit them, never the cache

    def _draw(self, index: int, split: str, n: int | None) -> tuple[list[int], list[int]]:
        """A fresh draw of example ``index`` of ``split`` (a split of ``n`` examples; None: unbounded)."""
        rng = np.random.default_rng([self.seed, SPLIT_CODES[split], index, _name_code(self.name)])
        words, mask = self.generate(rng, index, split)
        if n is None:  # unbounded task: keep train and test disjoint by content
            want_test = split == "test"
            for _ in range(100 * TEST_BUCKETS):
                if _is_test_example(words) == want_test:
                    break
                words, mask = self.generate(rng, index, split)
            else:  # pragma: no cover - only for degenerate task_args with a handful of distinct examples
                raise DataError(
                    f"synthetic task {self.name!r}: too few distinct examples to split train/test. Fix: enlarge task_args"
                )
        words = words + [EOS]
        mask = list(mask) + [int(self.score_eos)]
        return [self.ids[w] for w in words], mask

    def decode(self, tokens) -> str:
        """Readable text of token ids (pads dropped)."""
        return self.word_sep.join(self.symbols[int(t)] for t in tokens if int(t) != self.pad_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.args}, vocab={self.vocab_size}, max_len={self.max_len})"


def _digits(n: int, width: int) -> list[str]:
    return list(str(n).zfill(width))


class Addition(Task):
    """Reversed decimal addition: ``rev(a) + rev(b) = rev(a+b) <eos>``.

    Reversed digits put the least significant digit first, so the carry flows left-to-right
    the way an autoregressive model generates. Two layouts:

    - ``padded`` (the default): operands of up to ``n_digits`` digits written with leading zeros, the
      sum with ``n_digits + 1``, in the operands' digit tokens; scored: every sum digit and ``<eos>``.
    - ``reference``: the reference implementation's ``additionstream_N``: operands of exactly
      ``n_digits`` digits (no leading zero), the sum without leading zeros in answer tokens of its own
      (``a0``..``a9``), then ``<stop>``, then ``<fill>`` when the sum has only ``n_digits`` digits (its
      pad, which it scores), so every example has 3N + 4 tokens before ``<eos>``. Scored as there:
      every answer token after the first, ``<stop>`` and ``<fill>`` (N + 1 per example); the first
      sum digit is neither trained nor scored.
    """

    name = "addition"
    DEFAULTS = {"n_digits": 4, "layout": "padded"}
    LAYOUTS = ("padded", "reference")
    word_sep = ""
    score_eos = True

    def build_symbols(self):
        digits = [str(d) for d in range(10)]
        if self.layout == "reference":
            return digits + ["+", "="] + [f"a{d}" for d in range(10)] + ["<stop>", "<fill>"]
        return digits + ["+", "="]

    def check(self):
        if not 1 <= self.n_digits <= 18:
            raise DataError(f"addition: n_digits must be in [1, 18], got {self.n_digits}")
        if self.layout not in self.LAYOUTS:
            raise DataError(f"addition: layout must be one of {list(self.LAYOUTS)}, got {self.layout!r}")
        self.score_eos = self.layout == "padded"

    @property
    def max_len(self):
        return 3 * self.n_digits + (4 if self.layout == "padded" else 5)

    def generate(self, rng, index, split):
        n = self.n_digits
        if self.layout == "padded":
            a, b = (int(x) for x in rng.integers(0, 10**n, size=2))
            prompt = _digits(a, n)[::-1] + ["+"] + _digits(b, n)[::-1] + ["="]
            answer = _digits(a + b, n + 1)[::-1]
            return prompt + answer, [0] * len(prompt) + [1] * len(answer)
        a, b = (int(x) for x in rng.integers(10 ** (n - 1), 10**n, size=2))
        prompt = list(str(a)[::-1]) + ["+"] + list(str(b)[::-1]) + ["="]
        answer = [f"a{c}" for c in str(a + b)[::-1]] + ["<stop>"]
        answer += ["<fill>"] * (n + 2 - len(answer))
        return prompt + answer, [0] * (len(prompt) + 1) + [1] * (len(answer) - 1)


def _balanced(s) -> bool:
    depth = 0
    for c in s:
        depth += 1 if c == "(" else -1
        if depth < 0:
            return False
    return depth == 0


class Dyck1(Task):
    """Is a bracket string balanced? ``( ) ( ( ) ) ? T <eos>``; scored: the T/F token.

    Negatives are half count-mismatched (one bracket flipped) and half count-matched but
    with a prefix that goes negative (a swapped pair), so counting alone is not enough.
    """

    name = "dyck"
    DEFAULTS = {"min_length": 2, "max_length": 16}

    def build_symbols(self):
        return ["(", ")", "?", "T", "F"]

    def check(self):
        if self.min_length < 2 or self.max_length < self.min_length or self.max_length % 2 or self.min_length % 2:
            raise DataError("dyck: need even min_length >= 2 and even max_length >= min_length")

    @property
    def max_len(self):
        return self.max_length + 3

    def _random_balanced(self, rng, length):
        out, depth = [], 0
        for pos in range(length):
            remaining = length - pos
            if depth == 0:
                c = "("
            elif depth == remaining:
                c = ")"
            else:
                c = "(" if rng.random() < 0.5 else ")"
            depth += 1 if c == "(" else -1
            out.append(c)
        return out

    def generate(self, rng, index, split):
        length = int(rng.integers(self.min_length // 2, self.max_length // 2 + 1)) * 2
        s = self._random_balanced(rng, length)
        balanced = rng.random() < 0.5
        if not balanced:
            if rng.random() < 0.5 or length < 4:
                i = int(rng.integers(length))
                s[i] = "(" if s[i] == ")" else ")"
            else:
                for _ in range(100):
                    opens = [i for i, c in enumerate(s) if c == "("]
                    i = opens[int(rng.integers(len(opens)))]
                    closes = [j for j, c in enumerate(s) if c == ")" and j > i]
                    j = closes[int(rng.integers(len(closes)))]
                    t = list(s)
                    t[i], t[j] = t[j], t[i]
                    if not _balanced(t):
                        s = t
                        break
                else:  # pragma: no cover - a swap of the first '(' with the last ')' always works
                    s[0], s[-1] = ")", "("
        label = "T" if _balanced(s) else "F"
        words = s + ["?", label]
        return words, [0] * (len(words) - 1) + [1]


class KVRetrieval(Task):
    """Key-value retrieval / needle in a haystack; scored: the value.

    Between ``min_pairs`` and ``n_pairs`` distinct keys (from ``n_keys``), each with a random value (from
    ``n_values``); the query is one of them. ``query: marker`` writes ``k v k v ... ? k v``;
    ``query: token`` writes the queried key as a token of its own, ``k v k v ... qk v``, the layout of
    the reference implementation's ``condattendstream_N`` (there with n_keys = n_pairs = N and 255
    values). Raising ``n_pairs`` turns it into a longer haystack.
    """

    name = "kv_retrieval"
    DEFAULTS = {"n_pairs": 8, "min_pairs": 1, "n_keys": 16, "n_values": 16, "query": "marker"}
    QUERIES = ("marker", "token")

    def build_symbols(self):
        keys, values = [f"k{i}" for i in range(self.n_keys)], [f"v{i}" for i in range(self.n_values)]
        return keys + values + (["?"] if self.query == "marker" else [f"q{i}" for i in range(self.n_keys)])

    def check(self):
        if not 1 <= self.min_pairs <= self.n_pairs <= self.n_keys:
            raise DataError(f"kv_retrieval: need 1 <= min_pairs <= n_pairs <= n_keys, got {self.args}")
        if self.query not in self.QUERIES:
            raise DataError(f"kv_retrieval: query must be one of {list(self.QUERIES)}, got {self.query!r}")

    @property
    def max_len(self):
        return 2 * self.n_pairs + (4 if self.query == "marker" else 3)

    def generate(self, rng, index, split):
        n = int(rng.integers(self.min_pairs, self.n_pairs + 1))
        keys = rng.choice(self.n_keys, size=n, replace=False)
        vals = rng.integers(0, self.n_values, size=n)
        q = int(rng.integers(n))
        words = []
        for k, v in zip(keys, vals):
            words += [f"k{k}", f"v{v}"]
        words += ["?", f"k{keys[q]}"] if self.query == "marker" else [f"q{keys[q]}"]
        words += [f"v{vals[q]}"]
        return words, [0] * (len(words) - 1) + [1]


class ModularAddition(Task):
    """``a b (a+b mod p)``, the paper's format; scored: the result. A fixed split of all p*p pairs (95/5 by default).

    No ``+``/``=`` tokens: the result is predicted at b's position, as in the paper's
    `[a, b, (a+b) mod p]` sequences.
    """

    name = "modular_addition"
    version = "v2"  # v1 had "+" and "=" tokens
    DEFAULTS = {"p": 97, "train_fraction": 0.95}

    def build_symbols(self):
        return [str(i) for i in range(self.p)]

    def check(self):
        if self.p < 2 or not 0 < self.train_fraction < 1:
            raise DataError(f"modular_addition: need p >= 2 and 0 < train_fraction < 1, got {self.args}")
        perm = np.random.default_rng([self.seed, _name_code(self.name), self.p]).permutation(self.p * self.p)
        self.train_size = int(round(self.train_fraction * self.p * self.p))
        self.test_size = self.p * self.p - self.train_size
        self._pairs = perm

    @property
    def max_len(self):
        return 4

    def pair(self, index: int, split: str) -> tuple[int, int]:
        j = index if self._split(split) == "train" else self.train_size + index
        return divmod(int(self._pairs[j]), self.p)

    def generate(self, rng, index, split):
        a, b = self.pair(index, split)
        return [str(a), str(b), str((a + b) % self.p)], [0, 0, 1]


def memorization_capacity_bits(n_pairs: int, n_labels: int, accuracy: float) -> float:
    """Bits stored by a model that labels ``n_pairs`` random pairs with ``accuracy``.

    Labels are uniform over C = ``n_labels`` classes. A model that is right with probability
    ``a`` and otherwise wrong uniformly is a C-ary symmetric channel, whose information per
    pair is ``I(a) = log2 C - H2(a) - (1 - a) * log2(C - 1)`` (H2 = binary entropy), clipped
    at 0 for chance accuracy ``a <= 1/C``. Capacity = ``n_pairs * I(a)``; at ``a = 1`` this is
    ``n_pairs * log2 C``.
    """
    C = int(n_labels)
    if C < 2:
        raise ValueError("n_labels must be >= 2")
    a = min(max(float(accuracy), 0.0), 1.0)
    if a <= 1.0 / C:
        return 0.0

    def xlog2(x):
        return 0.0 if x <= 0 else x * math.log2(x)

    h2 = -xlog2(a) - xlog2(1 - a)
    per_pair = math.log2(C) - h2 - (1 - a) * math.log2(C - 1)
    return float(n_pairs) * max(0.0, per_pair)


class Memorization(Task):
    """Random labels for every pair ``(x1, x2)``: ``x1 x2 = y``; scored: y. Train = test."""

    name = "memorization"
    DEFAULTS = {"n1": 32, "n2": 32, "n_labels": 16}

    def build_symbols(self):
        return (
            [f"a{i}" for i in range(self.n1)]
            + [f"b{i}" for i in range(self.n2)]
            + ["="]
            + [f"y{i}" for i in range(self.n_labels)]
        )

    def check(self):
        if self.n1 < 1 or self.n2 < 1 or self.n_labels < 2:
            raise DataError(f"memorization: need n1, n2 >= 1 and n_labels >= 2, got {self.args}")
        self.train_size = self.test_size = self.n1 * self.n2
        self.labels = np.random.default_rng([self.seed, _name_code(self.name)]).integers(
            0, self.n_labels, self.train_size
        )

    @property
    def n_pairs(self) -> int:
        return self.n1 * self.n2

    @property
    def max_len(self):
        return 5

    def capacity_bits(self, accuracy: float) -> float:
        return memorization_capacity_bits(self.n_pairs, self.n_labels, accuracy)

    def generate(self, rng, index, split):
        x1, x2 = divmod(index, self.n2)
        return [f"a{x1}", f"b{x2}", "=", f"y{self.labels[index]}"], [0, 0, 0, 1]


class MQAR(Task):
    """Multi-query associative recall: ``k v k v ... | q a q a ...``; scored: every answer a."""

    name = "mqar"
    DEFAULTS = {"n_pairs": 8, "n_queries": 4, "n_keys": 32, "n_values": 32}

    def build_symbols(self):
        return [f"k{i}" for i in range(self.n_keys)] + [f"v{i}" for i in range(self.n_values)]

    def check(self):
        if not (1 <= self.n_queries <= self.n_pairs <= self.n_keys):
            raise DataError(f"mqar: need 1 <= n_queries <= n_pairs <= n_keys, got {self.args}")

    @property
    def max_len(self):
        return 2 * self.n_pairs + 2 * self.n_queries + 1

    def generate(self, rng, index, split):
        keys = rng.choice(self.n_keys, size=self.n_pairs, replace=False)
        vals = rng.integers(0, self.n_values, size=self.n_pairs)
        words, mask = [], []
        for k, v in zip(keys, vals):
            words += [f"k{k}", f"v{v}"]
            mask += [0, 0]
        for q in rng.choice(self.n_pairs, size=self.n_queries, replace=False):
            words += [f"k{keys[q]}", f"v{vals[q]}"]
            mask += [0, 1]
        return words, mask


def khop_target(seq, k: int):
    """Follow 'the token after the previous occurrence of the current token' k times.

    Starts at the last position; returns the token reached, or None where a hop finds no
    earlier occurrence. Needs no two equal adjacent tokens so every hop moves strictly left.
    """
    pos = len(seq) - 1
    for _ in range(k):
        cur = seq[pos]
        prev = next((s for s in range(pos - 1, -1, -1) if seq[s] == cur), None)
        if prev is None:
            return None
        pos = prev + 1
    return seq[pos]


class KHopInduction(Task):
    """k-hop induction heads: ``x_1 ... x_T = y``; y is ``khop_target(x, k)``; scored: y.

    Sequences are redrawn (deterministically) until every hop is defined, and never
    contain two equal adjacent tokens.
    """

    name = "khop"
    DEFAULTS = {"k": 2, "length": 24, "n_symbols": 8}

    def build_symbols(self):
        return [f"s{i}" for i in range(self.n_symbols)] + ["="]

    def check(self):
        if self.k < 1 or self.n_symbols < 2 or self.length < 2 * self.k + 1:
            raise DataError(f"khop: need k >= 1, n_symbols >= 2, length >= 2k+1, got {self.args}")

    @property
    def max_len(self):
        return self.length + 3

    def _sequence(self, rng) -> list[int]:
        first = int(rng.integers(self.n_symbols))
        steps = rng.integers(1, self.n_symbols, size=self.length - 1)  # never 0: no adjacent repeats
        return np.concatenate([[first], (first + np.cumsum(steps)) % self.n_symbols]).tolist()

    def generate(self, rng, index, split):
        for _ in range(10_000):
            seq = self._sequence(rng)
            y = khop_target(seq, self.k)
            if y is not None:
                return [f"s{t}" for t in seq] + ["=", f"s{y}"], [0] * (len(seq) + 1) + [1]
        raise DataError(f"khop: could not draw a sequence with a defined {self.k}-hop chain. Fix: raise length")


class KHopDense(KHopInduction):
    """k-hop induction scored at every position: ``x_1 y_1 x_2 y_2 ... x_T y_T``, where
    ``y_t = khop_target(x_1..x_t, k)`` in an answer alphabet (``a0``...; ``a_`` where a hop finds no
    earlier occurrence, unscored). The same sequences as ``khop``; what differs is the supervision:
    about T answers per example instead of one, so a small model gets T times the signal per step
    (the task of Sanford et al. 2024, where hop_k is output at every position, in next-token form).
    ``y_t`` is predicted at ``x_t``'s position; answers never match a sequence symbol, so they do not
    create "previous occurrences".
    """

    name = "khop_dense"

    def build_symbols(self):
        return [f"s{i}" for i in range(self.n_symbols)] + [f"a{i}" for i in range(self.n_symbols)] + ["a_"]

    @property
    def max_len(self):
        return 2 * self.length + 1

    def generate(self, rng, index, split):
        for _ in range(10_000):
            seq = self._sequence(rng)
            words, mask = [], []
            for t in range(len(seq)):
                y = khop_target(seq[: t + 1], self.k)
                words += [f"s{seq[t]}", "a_" if y is None else f"a{y}"]
                mask += [0, 0 if y is None else 1]
            if khop_target(seq, self.k) is not None:  # the last position is always scored
                return words, mask
        raise DataError(f"khop_dense: could not draw a sequence with a defined {self.k}-hop chain. Fix: raise length")


class CopySpan(Task):
    """Induction on random tokens: ``length`` symbols drawn uniformly, with a run of ``min_span`` to
    ``max_span`` of them written again right after itself, at a random point; scored: the copy after
    its first token. Only an induction head predicts it (find the earlier occurrence of the current
    token, read the token after it): the span length, and with it the distance between the copies,
    varies from example to example, so a head that reads a fixed offset back cannot. (With a fixed
    distance, as in ``[x, x]`` with a constant length, a positional head copies instead.)
    """

    name = "copy_span"
    DEFAULTS = {"n_symbols": 64, "length": 128, "min_span": 4, "max_span": 64}

    def build_symbols(self):
        return [f"t{i}" for i in range(self.n_symbols)]

    def check(self):
        if self.n_symbols < 2 or not 2 <= self.min_span <= self.max_span or 2 * self.max_span > self.length:
            raise DataError(f"copy_span: need n_symbols >= 2, 2 <= min_span <= max_span <= length/2, got {self.args}")

    @property
    def max_len(self):
        return self.length + 1

    def generate(self, rng, index, split):
        tokens = rng.integers(self.n_symbols, size=self.length)
        span = int(rng.integers(self.min_span, self.max_span + 1))
        at = int(rng.integers(0, self.length - 2 * span + 1))
        tokens[at + span : at + 2 * span] = tokens[at : at + span]
        mask = [0] * self.length
        mask[at + span + 1 : at + 2 * span] = [1] * (span - 1)
        return [f"t{t}" for t in tokens], mask


FILLER = ["the grass is green .", "the sky is blue .", "the sun is yellow .", "here we go .", "there and back again ."]


class Passkey(Task):
    """Passkey retrieval: filler sentences with ``the pass key is D D D D D .`` at a depth,
    then ``what is the pass key ?`` and the digits; scored: the key digits.

    ``depth`` in [0, 1] fixes where the key line goes (fraction of filler before it);
    ``None`` draws it per example. Raise ``n_filler`` for a longer context probe.
    """

    name = "passkey"
    DEFAULTS = {"n_digits": 5, "n_filler": 6, "depth": None}

    def build_symbols(self):
        words = sorted({w for s in FILLER for w in s.split()} | {"pass", "key", "what", "?"})
        return words + [str(d) for d in range(10)]

    def check(self):
        if self.n_digits < 1 or self.n_filler < 0 or (self.depth is not None and not 0 <= self.depth <= 1):
            raise DataError(f"passkey: need n_digits >= 1, n_filler >= 0, depth in [0, 1] or None, got {self.args}")

    @property
    def max_len(self):
        filler = sum(len(FILLER[i % len(FILLER)].split()) for i in range(self.n_filler))
        return filler + (5 + self.n_digits) + 6 + self.n_digits + 1

    def generate(self, rng, index, split):
        key = [str(int(d)) for d in rng.integers(0, 10, size=self.n_digits)]
        depth = float(rng.random()) if self.depth is None else float(self.depth)
        at = int(round(depth * self.n_filler))
        words = []
        for i in range(self.n_filler + 1):
            if i == at:
                words += ["the", "pass", "key", "is"] + key + ["."]
            if i < self.n_filler:
                words += FILLER[i % len(FILLER)].split()
        words += ["what", "is", "the", "pass", "key", "?"]
        mask = [0] * len(words) + [1] * self.n_digits
        return words + key, mask


TASKS = {
    cls.name: cls
    for cls in (
        Addition,
        Dyck1,
        KVRetrieval,
        ModularAddition,
        Memorization,
        MQAR,
        KHopInduction,
        KHopDense,
        CopySpan,
        Passkey,
    )
}


def list_tasks() -> list[str]:
    return sorted(TASKS)


def get_task(name: str, seed: int = DEFAULT_SEED, **task_args) -> Task:
    """The task ``name`` with ``task_args`` (see each class's DEFAULTS); ``seed`` fixes its content.

    ``n_val`` (the loader's validation size for unbounded tasks) is accepted and ignored, so
    the same ``task_args`` dict works here and in ``DataConfig``.
    """
    task_args.pop("n_val", None)
    if name.startswith("synthetic:"):
        name = name.split(":", 1)[1]
    if name not in TASKS:
        raise DataError(f"unknown synthetic task {name!r}. Fix: choose one of {list_tasks()}")
    return TASKS[name](seed=seed, **task_args)
