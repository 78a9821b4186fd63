"""Synthetic tasks: deterministic, correct answers, correct loss masks, disjoint splits, loader interface."""

from __future__ import annotations

import math

import pytest
import torch

from common.errors import DataError
from data_pipeline import DataConfig
from data_pipeline.loader import build_loader
from data_pipeline.synthetic import _balanced, get_task, khop_target, list_tasks, memorization_capacity_bits

ALL = list_tasks()


def test_all_tasks_present():
    assert set(ALL) == {
        "addition",
        "dyck",
        "kv_retrieval",
        "modular_addition",
        "memorization",
        "mqar",
        "khop",
        "khop_dense",
        "copy_span",
        "passkey",
    }


@pytest.mark.parametrize("name", ALL)
def test_task_contract(name):
    t = get_task(name)
    assert t.tokenizer_id == f"synthetic:{name}:{t.version}" and t.pad_id == 0 and t.eos_id == 1
    for split in ("train", "test"):
        for i in range(50):
            toks, mask = t.sample(i, split)
            assert (toks, mask) == get_task(name).sample(i, split)  # pure function of (seed, split, index)
            assert len(toks) == len(mask) <= t.max_len and toks[-1] == t.eos_id
            assert all(0 <= x < t.vocab_size for x in toks) and t.pad_id not in toks
            assert sum(mask) >= 1 and mask[0] == 0
    assert isinstance(t.decode(t.sample(0)[0]), str)
    other = get_task(name, seed=99)
    if name != "modular_addition":  # its content is all pairs; only the split changes with the seed
        assert any(other.sample(i)[0] != t.sample(i)[0] for i in range(20))


@pytest.mark.parametrize("name", ["memorization", "modular_addition", "addition"])
def test_finite_split_draws_once_and_returns_copies(name):
    """A finite split keeps each example after its first draw; what it returns is the same example a
    fresh task draws, and editing it in place (Addition scores its stop token that way) changes nothing."""
    t, fresh = get_task(name), get_task(name)
    finite = [s for s in ("train", "test") if t.size(s) is not None]  # addition: an unbounded stream
    for split in ("train", "test"):
        for i in range(30):
            first = t.sample(i, split)
            first[0][0], first[1][-1] = -1, 7  # a caller scribbling on its copy
            assert t.sample(i, split) == fresh.sample(i, split)
    assert len(t._drawn) == 30 * len(finite)


def _scored(t, toks, mask):
    return [t.symbols[x] for x, m in zip(toks, mask) if m]


def test_addition_answers():
    t = get_task("addition", n_digits=3)
    for i in range(100):
        toks, mask = t.sample(i)
        s = t.decode(toks)
        a, rest = s.split("+")
        b, c = rest.split("=")
        assert int(a[::-1]) + int(b[::-1]) == int(c.replace("<eos>", "")[::-1])
        assert "".join(_scored(t, toks, mask)) == c  # sum digits + stop token are scored
        assert len(toks) == 3 * 3 + 4


def test_dyck_labels_and_balance():
    t = get_task("dyck")
    labels = []
    for i in range(400):
        toks, mask = t.sample(i)
        words = [t.symbols[x] for x in toks]
        q = words.index("?")
        assert _scored(t, toks, mask) == [words[q + 1]]
        assert words[q + 1] == ("T" if _balanced(words[:q]) else "F")
        labels.append(words[q + 1])
    assert 0.4 < labels.count("T") / len(labels) < 0.6


def test_kv_retrieval_answer_and_range():
    t = get_task("kv_retrieval", n_pairs=6)
    counts = set()
    for i in range(200):
        toks, mask = t.sample(i)
        w = [t.symbols[x] for x in toks]
        q = w.index("?")
        pairs = dict(zip(w[:q:2], w[1:q:2]))
        counts.add(len(pairs))
        assert _scored(t, toks, mask) == [pairs[w[q + 1]]] == [w[q + 2]]
    assert counts == set(range(1, 7))


def test_mqar_answers():
    t = get_task("mqar")
    toks, mask = t.sample(3)
    w = [t.symbols[x] for x in toks]
    n = 2 * t.n_pairs
    pairs = dict(zip(w[:n:2], w[1:n:2]))
    queries = w[n:-1]
    assert [pairs[k] for k in queries[::2]] == queries[1::2] == _scored(t, toks, mask)


def _khop_bruteforce(seq, k):
    pos = len(seq) - 1
    for _ in range(k):
        prev = [s for s in range(pos) if seq[s] == seq[pos]]
        if not prev:
            return None
        pos = max(prev) + 1
    return seq[pos]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_khop_labels(k):
    t = get_task("khop", k=k)
    for i in range(100):
        toks, mask = t.sample(i)
        w = [t.symbols[x] for x in toks]
        seq = w[: t.length]
        assert all(a != b for a, b in zip(seq, seq[1:]))
        assert w[t.length] == "=" and _scored(t, toks, mask) == [_khop_bruteforce(seq, k)] == [khop_target(seq, k)]
    assert khop_target([1, 2, 3, 1], 1) == 2 and khop_target([1, 2, 3, 1], 2) is None
    assert khop_target([5, 1, 2, 5, 2], 2) == 1  # 2 -> token after previous 2 (5) -> token after previous 5 (1)


@pytest.mark.parametrize("k", [1, 2])
def test_khop_dense_scores_every_defined_position(k):
    t, single = get_task("khop_dense", k=k), get_task("khop", k=k)
    for i in range(50):
        toks, mask = t.sample(i)
        w = [t.symbols[x] for x in toks[:-1]]
        seq = w[0::2]
        assert len(seq) == t.length and all(a != b for a, b in zip(seq, seq[1:]))
        for pos, (ans, m) in enumerate(zip(w[1::2], mask[1:-1:2])):
            want = _khop_bruteforce(seq[: pos + 1], k)
            assert (ans, m) == (("a_", 0) if want is None else ("a" + want[1:], 1))
        assert mask[0::2] == [0] * (len(toks) + 1 >> 1) and sum(mask) >= 1 and mask[-2] == 1
    assert t.vocab_size == single.vocab_size + t.n_symbols  # answers a0.. and a_ replace "="


def test_copy_span_scores_exactly_the_predictable_copy():
    t = get_task("copy_span", n_symbols=16, length=40, min_span=3, max_span=12)
    spans = set()
    for i in range(200):
        toks, mask = t.sample(i)
        seq, scored = toks[:-1], [p for p, m in enumerate(mask) if m]
        assert len(seq) == 40 and mask[-1] == 0
        # the scored run is contiguous; it copies the `span` tokens before the copy's start
        start, end = scored[0] - 1, scored[-1] + 1
        span = end - start
        assert scored == list(range(start + 1, end)) and 3 <= span <= 12
        assert seq[start:end] == seq[start - span : start]
        spans.add(span)
    assert len(spans) == 10  # every span length 3..12 occurs: the distance between the copies varies
    with pytest.raises(DataError, match="copy_span"):
        get_task("copy_span", length=20, max_span=11)


def test_modular_addition_split():
    t = get_task("modular_addition", p=23)
    train = {t.pair(i, "train") for i in range(t.train_size)}
    test = {t.pair(i, "test") for i in range(t.test_size)}
    assert not train & test and len(train | test) == 23 * 23
    assert t.train_size == round(0.95 * 23 * 23)
    toks, mask = t.sample(0, "test")
    a, b, c = (t.symbols[x] for x in toks[:3])
    assert (int(a) + int(b)) % 23 == int(c) and mask == [0, 0, 1, 0]
    with pytest.raises(IndexError):
        t.sample(t.test_size, "test")


def test_memorization_train_is_test_and_capacity():
    t = get_task("memorization", n1=4, n2=5, n_labels=8)
    assert t.train_size == t.test_size == 20
    assert [t.sample(i, "train") for i in range(20)] == [t.sample(i, "test") for i in range(20)]
    assert memorization_capacity_bits(20, 8, 1.0) == pytest.approx(20 * 3)
    assert memorization_capacity_bits(20, 8, 1 / 8) == 0.0 and memorization_capacity_bits(20, 8, 0.05) == 0.0
    a = 0.5
    expect = 20 * (3 + a * math.log2(a) + (1 - a) * math.log2(1 - a) - (1 - a) * math.log2(7))
    assert t.capacity_bits(a) == pytest.approx(expect)
    assert 0 < t.capacity_bits(0.3) < t.capacity_bits(0.6) < t.capacity_bits(0.9) < 60


def test_passkey_depth_and_answer():
    t = get_task("passkey", depth=0.0, n_filler=4)
    toks, mask = t.sample(5)
    w = [t.symbols[x] for x in toks]
    assert w[:4] == ["the", "pass", "key", "is"]
    key = w[4:9]
    assert _scored(t, toks, mask) == key and w[-6:-1] == key
    deep = [t2 for t2 in (get_task("passkey", depth=1.0, n_filler=4).sample(5)[0],)][0]
    wd = [t.symbols[x] for x in deep]
    assert wd[wd.index("pass") - 1] == "the" and wd.index("pass") > 10


def test_train_and_test_streams_differ():
    for name in ("addition", "kv_retrieval", "khop", "khop_dense", "mqar", "dyck", "passkey"):
        t = get_task(name)
        train = {tuple(t.sample(i, "train")[0]) for i in range(300)}
        test = {tuple(t.sample(i, "test")[0]) for i in range(300)}
        assert not train & test, name


def test_bad_task_args():
    with pytest.raises(DataError, match=r"unknown task_args \['n_pair'\]; valid"):
        get_task("kv_retrieval", n_pair=3)
    with pytest.raises(DataError, match="unknown synthetic task"):
        get_task("sorting")


# ---- through the loader interface ------------------------------------------------------


def _ld(task, split="train", W=1, r=0, gbs=8, seq_len=64, **task_args):
    cfg = DataConfig(source=f"synthetic:{task}", task_args=task_args, return_doc_ids=True)
    return build_loader(cfg, split=split, seq_len=seq_len, global_batch_size=gbs, dp_rank=r, dp_world_size=W)


def test_synthetic_batches_labels_and_padding():
    ld = _ld("kv_retrieval")
    t = ld.sources[0].task
    b = next(ld)
    assert b["input_ids"].shape == b["labels"].shape == b["doc_ids"].shape == (8, 64)
    assert ld.vocab_size == t.vocab_size and ld.tokenizer_id == "synthetic:kv_retrieval:v1" and ld.pad_id == 0
    for row in range(8):
        toks, mask = t.sample(row, "train")  # unbounded stream: sample k is example k
        n = len(toks) - 1
        assert b["input_ids"][row, :n].tolist() == toks[:-1]
        assert (b["input_ids"][row, n:] == 0).all() and (b["labels"][row, n:] == -100).all()
        scored = [i for i in range(n) if mask[i + 1]]
        assert torch.nonzero(b["labels"][row] != -100).flatten().tolist() == scored
        assert b["labels"][row, scored].tolist() == [toks[i + 1] for i in scored]
        assert (b["doc_ids"][row, :n] == 0).all() and (b["doc_ids"][row, n:] == 1).all()


def test_synthetic_world_size_and_resume():
    one = _ld("addition", gbs=8)
    ref = [next(one) for _ in range(3)]
    parts = [_ld("addition", gbs=8, W=4, r=r) for r in range(4)]
    got = [torch.cat([next(p)["input_ids"] for p in parts]) for _ in range(3)]
    assert all(torch.equal(a["input_ids"], g) for a, g in zip(ref, got))
    ld = _ld("addition", gbs=8)
    next(ld)
    fresh = _ld("addition", gbs=8, W=2, r=1)
    fresh.load_state_dict(ld.state_dict())
    assert torch.equal(next(fresh)["input_ids"], ref[1]["input_ids"][4:])


def test_finite_task_epochs_and_val():
    ld = _ld("modular_addition", gbs=16, seq_len=8, p=11)
    t = ld.sources[0].task
    n = ld.num_sequences
    assert n == t.train_size
    seen = [tuple(x) for _ in range(-(-n // 16)) for x in next(ld)["input_ids"][:, :3].tolist()][:n]
    assert len(set(seen)) == n  # one epoch = every train pair once
    va = _ld("modular_addition", split="val", gbs=16, seq_len=8, p=11)
    rows = torch.cat([b["input_ids"] for b in va.iter_epoch()])
    labels = torch.cat([b["labels"] for b in va.iter_epoch()])
    assert va.num_sequences == t.test_size and int((labels != -100).any(1).sum()) == t.test_size
    test_pairs = {(t.symbols[a], t.symbols[b]) for a, b in rows[: t.test_size, :2].tolist()}
    assert test_pairs == {tuple(map(str, t.pair(i, "test"))) for i in range(t.test_size)}
    assert len(list(_ld("kv_retrieval", split="val", gbs=8, n_val=20).iter_epoch())) == 3


def test_seq_len_too_short_for_task():
    with pytest.raises(DataError, match="use seq_len >= 19"):
        _ld("kv_retrieval", seq_len=16)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_addition_in_the_reference_layout(n):
    """additionstream_N: exactly N-digit operands, the sum without leading zeros in answer tokens of its
    own, <stop>, <fill> after an N-digit sum; 3N + 4 tokens before <eos>; scored: the answer tokens after
    the first, <stop> and <fill> (N + 1), as the reference trains and scores them."""
    t = get_task("addition", n_digits=n, layout="reference")
    short = long = 0
    for i in range(300):
        toks, mask = t.sample(i)
        w = [t.symbols[x] for x in toks]
        assert len(w) == 3 * n + 5 and w[-1] == "<eos>" and mask[-1] == 0
        plus, eq = w.index("+"), w.index("=")
        a, b = int("".join(w[:plus])[::-1]), int("".join(w[plus + 1 : eq])[::-1])
        assert 10 ** (n - 1) <= a < 10**n and 10 ** (n - 1) <= b < 10**n
        stop = w.index("<stop>")
        answer = [x[1] for x in w[eq + 1 : stop]]
        assert all(x.startswith("a") for x in w[eq + 1 : stop]) and int("".join(answer)[::-1]) == a + b
        assert answer[-1] != "0"  # no leading zero in the (reversed) sum
        assert w[stop + 1 :] == (["<fill>", "<eos>"] if len(answer) == n else ["<eos>"])
        assert sum(mask) == n + 1 and mask[: eq + 2] == [0] * (eq + 2) and all(mask[eq + 2 : 3 * n + 4])
        short, long = short + (len(answer) == n), long + (len(answer) == n + 1)
    assert short and long
    assert t.max_len == 3 * n + 5
    with pytest.raises(DataError, match="layout"):
        get_task("addition", layout="other")


def test_kv_retrieval_with_the_query_as_its_own_token():
    """condattendstream_N: keys from the N pairs' symbols, the queried key as a token of its own (no
    marker); the only scored token is its value."""
    t = get_task("kv_retrieval", n_pairs=8, n_keys=8, n_values=255, query="token")
    assert t.vocab_size == 2 + 8 + 255 + 8 and "?" not in t.symbols
    for i in range(200):
        toks, mask = t.sample(i)
        w = [t.symbols[x] for x in toks]
        assert w[-1] == "<eos>" and len(w) <= t.max_len == 2 * 8 + 3
        q = next(j for j, x in enumerate(w) if x.startswith("q"))
        pairs = dict(zip(w[:q:2], w[1:q:2]))
        assert len(pairs) == q // 2 and all(k.startswith("k") for k in pairs)
        assert _scored(t, toks, mask) == [pairs["k" + w[q][1:]]] == [w[q + 1]]
    with pytest.raises(DataError, match="query"):
        get_task("kv_retrieval", query="both")
