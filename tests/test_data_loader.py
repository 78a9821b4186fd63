"""The loader: global order independent of world size, exact resume, mixtures, val split, bad shards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import corpus_lines, make_tokenizer, write_text

from common.errors import DataError
from data_pipeline import DataConfig
from data_pipeline import loader as loader_mod
from data_pipeline.config import parse_data
from data_pipeline.loader import build_loader
from data_pipeline.order import MixtureSchedule, Permutation
from data_pipeline.prepare import prepare
from data_pipeline.shards import VERIFY_RECORD, ShardSet, read_manifest, verify_shards

L = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    tok = make_tokenizer(root / "tok")
    write_text(root / "a.txt", corpus_lines(400, "valid"))
    write_text(root / "b.txt", corpus_lines(300, "test"))
    prepare([str(root / "a.txt")], tok, root / "A", shard_tokens=7_000, progress=False)
    prepare([str(root / "b.txt")], tok, root / "B", shard_tokens=7_000, progress=False)
    other = make_tokenizer(root / "tok2", vocab_size=380, n_lines=500)
    prepare([str(root / "b.txt")], other, root / "C", progress=False)
    return {"root": root, "tok": tok, "A": root / "A", "B": root / "B", "C": root / "C"}


def _loader(source, split="train", W=1, r=0, gbs=8, **kw):
    cfg = kw.pop("cfg", None) or DataConfig(source=str(source), **kw)
    return build_loader(cfg, split=split, seq_len=L, global_batch_size=gbs, dp_rank=r, dp_world_size=W)


def _global_batches(make, W, steps, state=None):
    """Concatenate the rank batches of ``steps`` steps for world size W."""
    loaders = [make(W, r) for r in range(W)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    out = []
    for _ in range(steps):
        parts = [next(ld) for ld in loaders]
        out.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return out, loaders[0]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_text_windows_are_packed_stream_with_shifted_labels(data):
    ld = _loader(data["A"], return_doc_ids=True)
    s = ShardSet(data["A"])
    assert isinstance(s._bin(0), np.memmap)  # memory-mapped, not loaded
    assert len(s.names) >= 3  # windows cross shard boundaries
    b = next(ld)
    seqs = ld.global_indices(0)[:, 1]
    for row, w in enumerate(seqs):
        toks = s.read(w * L, w * L + L + 1)
        assert b["input_ids"][row].tolist() == toks[:-1].tolist()
        assert b["labels"][row].tolist() == toks[1:].tolist()
        d = b["doc_ids"][row]
        eos = (b["input_ids"][row] == ld.eos_id).long()
        assert d[0] == 0 and torch.equal(d[1:], torch.cumsum(eos, 0)[:-1])  # new doc after each EOS
    assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (8, L)
    assert ld.vocab_size == 400 and ld.tokenizer_id.startswith("sp:") and ld.pad_id == 3


@pytest.mark.parametrize("source", ["A", "mix"])
def test_same_global_order_for_world_sizes_1_2_4(data, source):
    def make(W, r):
        if source == "mix":
            cfg = DataConfig(
                source="mixture", mixture=[{"path": str(data["A"]), "weight": 2}, {"path": str(data["B"]), "weight": 1}]
            )
            return _loader(None, W=W, r=r, cfg=cfg)
        return _loader(data[source], W=W, r=r, return_doc_ids=True)

    ref, first = _global_batches(make, 1, 6)
    n = first.num_sequences
    # also straddle an epoch boundary: start 4 samples before the end of epoch 0
    jump = dict(first.state_dict(), samples_seen=n - 4)
    ref_b, _ = _global_batches(make, 1, 3, jump)
    for W in (2, 4):
        got, _ = _global_batches(make, W, 6)
        _same(ref, got)
        got_b, _ = _global_batches(make, W, 3, jump)
        _same(ref_b, got_b)


def test_epochs_cover_every_sequence_once_and_reshuffle(data):
    ld = _loader(data["A"])
    n = ld.num_sequences
    e0 = ld._locate(np.arange(n))[1]
    e1 = ld._locate(np.arange(n, 2 * n))[1]
    assert sorted(e0.tolist()) == list(range(n)) == sorted(e1.tolist())
    assert not np.array_equal(e0, e1) and not np.array_equal(e0, np.arange(n))
    other_seed = _loader(data["A"], seed=7)._locate(np.arange(n))[1]
    assert not np.array_equal(e0, other_seed)
    again = _loader(data["A"])._locate(np.arange(n))[1]
    assert np.array_equal(e0, again)


def test_resume_mid_epoch_gives_identical_remaining_stream(data):
    ld = _loader(data["A"], gbs=6, return_doc_ids=True)
    for _ in range(7):
        next(ld)
    state = json.loads(json.dumps(ld.state_dict()))  # survives a JSON checkpoint
    assert state["samples_seen"] == 42 and state["epoch"] == 0 and state["index_in_epoch"] == 42
    rest = [next(ld) for _ in range(5)]
    fresh = _loader(data["A"], gbs=6, return_doc_ids=True)
    fresh.load_state_dict(state)
    _same(rest, [next(fresh) for _ in range(5)])
    # ... and on a different world size the global stream continues unchanged
    got, last = _global_batches(lambda W, r: _loader(data["A"], W=W, r=r, gbs=6, return_doc_ids=True), 3, 5, state)
    _same(rest, got)
    assert last.samples_seen == 42 + 5 * 6


def test_state_from_a_different_stream_is_refused(data):
    state = _loader(data["A"]).state_dict()
    with pytest.raises(DataError, match="seed=1234.*different data stream"):
        _loader(data["A"], seed=5).load_state_dict(state)
    with pytest.raises(DataError, match="fingerprint"):
        _loader(data["B"]).load_state_dict(state)


def test_mixture_hits_weights_and_is_deterministic(data):
    mix = [
        {"path": str(data["A"]), "weight": 0.6},
        {"path": str(data["B"]), "weight": "0.3"},
        {"path": str(data["A"]), "weight": 0.1},
    ]
    ld = _loader(None, cfg=DataConfig(source="mixture", mixture=mix))
    comp, seq = ld._locate(np.arange(40_000))
    share = np.bincount(comp, minlength=3) / 40_000
    assert np.allclose(share, [0.6, 0.3, 0.1], atol=0.002)
    for c in range(3):  # each component walks its own shuffled epochs
        n = ld._sizes[c]
        first = seq[comp == c][:n]
        assert len(first) == n
        assert sorted(first.tolist()) == list(range(n))
    ld2 = _loader(None, cfg=DataConfig(source=f"mixture:{data['A']}=0.6,{data['B']}=0.3,{data['A']}=0.1"))
    assert np.array_equal(ld2._locate(np.arange(5000))[0], comp[:5000])
    zero = _loader(
        None,
        cfg=DataConfig(
            source="mixture", mixture=[{"path": str(data["A"]), "weight": 1}, {"path": str(data["B"]), "weight": 0}]
        ),
    )
    assert (zero._locate(np.arange(2000))[0] == 0).all()


def test_mixture_schedule_prefix_counts_are_exact():
    ms = MixtureSchedule([3, 1, 1], key=1)
    comp, local = ms.assign(np.arange(10_000))
    for K in (10, 100, 1000, 10_000):
        counts = np.bincount(comp[:K], minlength=3)
        assert np.all(np.abs(counts - K * np.array([0.6, 0.2, 0.2])) <= 2)
    for c in range(3):
        assert local[comp == c].tolist() == list(range((comp == c).sum()))


def test_permutation_is_bijection():
    for n in (1, 2, 3, 10, 1000, 4099):
        assert sorted(Permutation(n, 3)(np.arange(n)).tolist()) == list(range(n))


def test_validation_split_is_held_out_and_fixed(data):
    tr = _loader(data["A"], val_fraction=0.1)
    va = _loader(data["A"], split="val", val_fraction=0.1, gbs=4, return_doc_ids=True)
    assert va.sources[0].start == tr.sources[0].stop  # disjoint token regions
    assert tr.sources[0].start + (tr.num_sequences * L) < tr.sources[0].stop
    a = list(va.iter_epoch())
    b = list(va.iter_epoch())
    _same(a, b)
    assert len(a) == -(-va.num_sequences // va.global_batch_size) == -(-va.num_sequences // 4)
    assert va.samples_seen == 0
    n_rows = sum(int((x["labels"] != -100).any(1).sum()) for x in a)
    assert n_rows == va.num_sequences  # padding rows carry no loss
    halves = [
        list(_loader(data["A"], split="val", val_fraction=0.1, gbs=4, W=2, r=r, return_doc_ids=True).iter_epoch())
        for r in range(2)
    ]
    _same(a, [{k: torch.cat([x[k], y[k]]) for k in x} for x, y in zip(*halves)])


def test_mixture_validation_concatenates_components(data):
    cfg = DataConfig(
        source="mixture",
        val_fraction=0.05,
        mixture=[{"path": str(data["A"]), "weight": 1}, {"path": str(data["B"]), "weight": 3}],
    )
    va = _loader(None, split="val", cfg=cfg)
    assert va.num_sequences == sum(s.size for s in va.sources)
    assert len(list(va.iter_epoch())) == -(-va.num_sequences // va.global_batch_size)


# ---- bad input ------------------------------------------------------------------------------


@pytest.fixture
def copy_a(data, tmp_path):
    d = tmp_path / "A"
    shutil.copytree(data["A"], d)
    return d


def test_truncated_shard(copy_a):
    p = copy_a / "shard_00001.bin"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"shard_00001\.bin has .* bytes but the manifest .*truncated.*re-run"):
        _loader(copy_a)


def test_flipped_byte(copy_a):
    p = copy_a / "shard_00000.bin"
    raw = bytearray(p.read_bytes())
    raw[123] ^= 0x01
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"shard_00000\.bin fails its sha256 check"):
        _loader(copy_a)
    _loader(copy_a, verify="size")  # the cheap mode only checks lengths


def test_token_ids_beyond_vocab(copy_a):
    p = copy_a / "shard_00000.bin"
    arr = np.fromfile(p, dtype=np.uint16)
    arr[5] = 999
    arr.tofile(p)
    m = json.loads((copy_a / "manifest.json").read_text())
    m["shards"][0]["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()  # checksum consistent, ids not
    (copy_a / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"shard_00000\.bin contains token id 999 >= vocab_size 400"):
        _loader(copy_a)


def test_tokenizer_identity_mismatch(data):
    with pytest.raises(DataError, match=r"manifest\.json records tokenizer sp:.* but the training config's tokenizer"):
        _loader(data["C"], tokenizer=str(data["tok"]))
    _loader(data["A"], tokenizer=str(data["tok"]))  # the right one passes


def test_vocab_size_mismatch(data):
    with pytest.raises(
        DataError, match=r"manifest\.json has vocab_size 400 but the training config says vocab_size=512"
    ):
        _loader(data["A"], vocab_size=512)


def test_mixture_of_different_tokenizers(data):
    cfg = DataConfig(
        source="mixture", mixture=[{"path": str(data["A"]), "weight": 1}, {"path": str(data["C"]), "weight": 1}]
    )
    with pytest.raises(DataError, match="prepare every component with the same --tokenizer"):
        _loader(None, cfg=cfg)


@pytest.mark.parametrize(
    "mixture, msg",
    [
        ([{"path": "a", "weight": "lots"}], "weight 'lots' is not a number"),
        ([{"path": "a", "weight": 0}, {"path": "b", "weight": 0.0}], "weights sum to 0"),
        ([{"path": "a", "weight": -1}], "must be finite and >= 0"),
        ([{"path": "a"}], "must be a dict with keys 'path' and 'weight'"),
        ([], "non-empty list"),
    ],
)
def test_bad_mixture_weights(mixture, msg):
    with pytest.raises(DataError, match=msg):
        DataConfig(source="mixture", mixture=mixture)


def test_bad_mixture_string():
    with pytest.raises(DataError, match="has no weight"):
        DataConfig(source="mixture:/data/a")
    with pytest.raises(DataError, match="not a number"):
        DataConfig(source="mixture:/data/a=x")


def test_config_validation():
    with pytest.raises(DataError, match="unknown synthetic task 'nope'"):
        DataConfig(source="synthetic:nope")
    with pytest.raises(DataError, match="val_fraction must be in"):
        DataConfig(source="x", val_fraction=0.9)
    with pytest.raises(DataError, match="unknown keys"):
        parse_data({"source": "x", "sed": 1})
    with pytest.raises(DataError, match="task_args only applies"):
        DataConfig(source="x", task_args={"k": 1})
    assert parse_data({"source": "synthetic:khop", "task_args": {"k": 3}}).kind == "synthetic"


def test_bad_loader_arguments(data, tmp_path):
    with pytest.raises(DataError, match="global_batch_size 10 is not divisible by dp_world_size 4"):
        _loader(data["A"], gbs=10, W=4)
    with pytest.raises(DataError, match="dp_rank must be in"):
        _loader(data["A"], W=2, r=2)
    with pytest.raises(DataError, match="does not exist. Fix: create it with"):
        _loader(tmp_path / "missing")
    with pytest.raises(DataError, match="fewer than seq_len"):
        build_loader(
            DataConfig(source=str(data["A"])),
            split="train",
            seq_len=10**7,
            global_batch_size=1,
            dp_rank=0,
            dp_world_size=1,
        )


# ---- vectorised gather and prefetch: the same bytes as the per-row reference -------------------


def _reference_rows(src, idx, want_docs):
    """The loader's original per-row assembly (one ShardSet.read / doc_ids call per row)."""
    rows = []
    for w in idx:
        a = src.start + int(w) * L
        toks = src.shards.read(a, a + L + 1)
        d = src.shards.doc_ids(a, a + L)
        rows.append((toks[:-1], toks[1:], d - d[0] if want_docs else None))
    return rows


def test_vectorised_rows_equal_per_row_reference(data):
    ld = _loader(data["A"], return_doc_ids=True, prefetch=0)
    src = ld.sources[0]
    idx = np.arange(src.size)  # every window, including those crossing shard boundaries
    inp, lab, docs = src.fetch(idx, True)
    crossing = sum(1 for w in idx if len(list(src.shards._pieces(w * L, w * L + L + 1))) > 1)
    assert crossing >= 2
    for row, (i, l, d) in enumerate(_reference_rows(src, idx, True)):
        assert np.array_equal(inp[row], i) and np.array_equal(lab[row], l) and np.array_equal(docs[row], d)
    assert inp.dtype == lab.dtype == docs.dtype == np.int64
    starts = src.start + idx * L  # absolute document ids too, for windows of several lengths
    for n in (1, 2, L, 700):
        ok = starts[starts + n <= src.shards.num_tokens]
        g = src.shards.gather_doc_ids(ok, n)
        assert all(np.array_equal(g[r], src.shards.doc_ids(int(a), int(a) + n)) for r, a in enumerate(ok))


@pytest.mark.parametrize("source", ["A", "mix"])
def test_prefetch_gives_the_synchronous_stream_across_jumps(data, source):
    def make(prefetch):
        if source == "mix":
            return _loader(
                None,
                cfg=DataConfig(
                    source="mixture",
                    prefetch=prefetch,
                    return_doc_ids=True,
                    mixture=[{"path": str(data["A"]), "weight": 2}, {"path": str(data["B"]), "weight": 1}],
                ),
            )
        return _loader(data["A"], prefetch=prefetch, return_doc_ids=True)

    sync, fast = make(0), make(3)
    _same([next(sync) for _ in range(6)], [next(fast) for _ in range(6)])
    state = sync.state_dict()
    jump = dict(state, samples_seen=5 * 8)  # back to step 5 (a rollback), then forward again
    sync.load_state_dict(jump)
    fast.load_state_dict(jump)
    _same([next(sync) for _ in range(4)], [next(fast) for _ in range(4)])
    assert fast.samples_seen == sync.samples_seen == 9 * 8
    assert fast._prefetcher._thread.daemon
    fast.close()


# ---- verification once per run, and shards changed under a live map -----------------------------


def test_verification_record_hashes_once(copy_a, tmp_path):
    m = read_manifest(copy_a)
    rec = tmp_path / "run"
    assert verify_shards(copy_a, m, mode="full", record_dir=rec) == "hashed"
    assert verify_shards(copy_a, m, mode="full", record_dir=rec) == "recorded"
    (entry,) = json.loads((rec / VERIFY_RECORD).read_text())["verified"].values()
    assert entry["shards"] == len(m["shards"]) and entry["source"] == str(copy_a.resolve())
    # a shard rewritten with a flipped byte (same size, new mtime) is not covered by the record
    p = copy_a / "shard_00002.bin"
    raw = bytearray(p.read_bytes())
    raw[7] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"shard_00002\.bin fails its sha256 check"):
        verify_shards(copy_a, m, mode="full", record_dir=rec)
    # size checks still run on every call, record or not
    p.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match=r"shard_00002\.bin has \d+ bytes but"):
        verify_shards(copy_a, m, mode="full", record_dir=rec)


_VERIFY_SCRIPT = """
import sys
from data_pipeline.shards import read_manifest, verify_shards
d, rec = sys.argv[1:3]
print(verify_shards(d, read_manifest(d), mode="full", record_dir=rec))
"""


def test_verification_record_one_of_many_ranks_hashes(copy_a, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _VERIFY_SCRIPT, str(copy_a), str(tmp_path / "run")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    outs = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outs == ["hashed", "recorded", "recorded", "recorded"], outs


def test_build_loader_writes_the_record(copy_a, tmp_path, monkeypatch):
    monkeypatch.setattr(loader_mod, "_VERIFIED", set())  # as in a fresh process
    build_loader(
        DataConfig(source=str(copy_a)), split="train", seq_len=L, global_batch_size=8, verify_record=tmp_path / "run"
    )
    assert len(json.loads((tmp_path / "run" / VERIFY_RECORD).read_text())["verified"]) == 1


def test_shard_truncated_or_replaced_under_a_live_map(copy_a):
    ld = _loader(copy_a, prefetch=0)
    s = ld.sources[0].shards
    starts = np.arange(0, 6000, 97)  # all inside shard 0
    before = s.gather(starts, L)
    assert isinstance(s._bin(0), np.memmap)
    p = copy_a / "shard_00000.bin"
    raw = p.read_bytes()
    with open(p, "r+b") as f:  # truncated in place: same inode
        f.truncate(len(raw) // 2)
    with pytest.raises(DataError, match=r"shard .*shard_00000\.bin has \d+ bytes but the manifest says .*truncated"):
        s.gather(starts, L)  # a DataError, not a SIGBUS
    with pytest.raises(DataError, match=r"shard_00000\.bin has"):
        next(_loader(copy_a, gbs=ld.num_sequences, prefetch=2))  # through the loader's prefetch thread
    tmp = p.with_name("new.bin")
    tmp.write_bytes(raw)
    os.replace(tmp, p)  # same bytes, but a different file
    with pytest.raises(DataError, match=r"shard_00000\.bin was replaced or modified"):
        s.gather(starts, L)
    fresh = ShardSet(copy_a)  # opened anew, the restored shard reads fine
    assert np.array_equal(fresh.gather(starts, L), before)
