"""Tokenizer training/loading and shard preparation: determinism, crash safety, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fixtures import corpus_lines, make_tokenizer, write_text

from common.errors import DataError
from data_pipeline import DataConfig
from data_pipeline.loader import build_loader
from data_pipeline.prepare import DELAY_ENV, prepare
from data_pipeline.shards import ShardSet, read_manifest
from data_pipeline.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    lines = corpus_lines(2000)
    write_text(d / "a.txt", lines[:1200])
    write_text(d / "b.txt", ["", "   "] + lines[1200:])  # whitespace-only docs are skipped
    return d


def _shard_bytes(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.glob("shard_*"))}


def test_tokenizer_cli_trains_and_reports_identity(tmp_path):
    src = write_text(tmp_path / "t.txt", corpus_lines(600))
    out = tmp_path / "tok"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_pipeline.tokenizer",
            "train",
            "--input",
            str(src),
            "--vocab-size",
            "400",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    assert "[tokenizer] training BPE" in r.stderr and "done" in r.stderr
    t = load_tokenizer(out)
    assert t.vocab_size == 400 and t.identity.startswith("sp:") and t.eos_id == 2
    text = "Lobsters 1234 éŝ 漢字"
    assert t.decode(t.encode(text)) == text  # byte fallback round-trips anything
    meta = json.loads((out / "tokenizer_meta.json").read_text())
    assert meta["identity"] == t.identity


def test_hf_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    t = load_tokenizer(tmp_path)
    assert t.kind == "hf" and t.identity.startswith("hf:") and t.vocab_size == 4 and t.eos_id == 1
    assert t.encode_batch(["hello world", "world"]) == [[2, 3], [3]]


def test_prepare_manifest_and_worker_count_invariance(tmp_path, tok, corpus):
    m1 = prepare([str(corpus)], tok, tmp_path / "w1", workers=1, shard_tokens=20_000, progress=False)
    m2 = prepare([str(corpus / "*.txt")], tok, tmp_path / "w2", workers=2, shard_tokens=20_000, progress=False)
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w2")
    assert m1["shards"] == m2["shards"] and len(m1["shards"]) >= 3
    t = load_tokenizer(tok)
    assert m1["tokenizer_id"] == t.identity and m1["vocab_size"] == t.vocab_size and m1["dtype"] == "uint16"
    assert m1["source_docs"] == 2002 and m1["num_docs"] == 2000
    s = ShardSet(tmp_path / "w1")
    # the stream is exactly: each document's tokens followed by EOS, in source order
    lines = corpus_lines(2000)
    expect = []
    for ln in lines[:5]:
        expect += t.encode(ln) + [t.eos_id]
    assert s.read(0, len(expect)).tolist() == expect
    assert s.doc_ids(0, len(expect))[-1] == 4
    # every shard but the last reaches shard_tokens and ends on a document boundary
    for sh in m1["shards"][:-1]:
        assert sh["num_tokens"] >= 20_000
    # a second run is a no-op
    again = prepare([str(corpus)], tok, tmp_path / "w1", workers=1, shard_tokens=20_000, progress=False)
    assert again["shards"] == m1["shards"]


def test_prepare_jsonl_and_parquet(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = corpus_lines(300)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": i, "body": ln}) + "\n" for i, ln in enumerate(lines)))
    pq.write_table(pa.table({"body": lines}), tmp_path / "d.parquet")
    a = prepare([str(tmp_path / "d.jsonl")], tok, tmp_path / "j", text_field="body", progress=False)
    b = prepare([str(tmp_path / "d.parquet")], tok, tmp_path / "p", text_field="body", progress=False)
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    with pytest.raises(DataError, match="no field 'text'.*--text-field"):
        prepare([str(tmp_path / "d.jsonl")], tok, tmp_path / "x", progress=False)


def test_sigkill_mid_prepare_resumes_byte_identical(tmp_path, tok, corpus):
    ref = tmp_path / "ref"
    prepare([str(corpus)], tok, ref, shard_tokens=8_000, progress=False)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "data_pipeline.prepare",
        "--source",
        str(corpus),
        "--tokenizer",
        str(tok),
        "--out",
        str(out),
        "--shard-tokens",
        "8000",
        "--quiet",
    ]
    proc = subprocess.Popen(
        cmd, env={**_env(), DELAY_ENV: "0.4"}, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            p = out / "progress.json"
            if p.is_file() and len(json.loads(p.read_text())["shards"]) >= 2:
                break
            assert proc.poll() is None, "prepare finished before it could be interrupted"
            time.sleep(0.05)
        time.sleep(0.2)  # land inside the next shard's write
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "manifest.json").exists()
    done = json.loads((out / "progress.json").read_text())["shards"]
    assert 2 <= len(done) < len(json.loads((ref / "manifest.json").read_text())["shards"])
    with pytest.raises(DataError, match="interrupted.*re-run"):
        build_loader(DataConfig(source=str(out)), split="train", seq_len=16, global_batch_size=2)
    finished = {s["name"]: (out / f"{s['name']}.bin").stat().st_mtime_ns for s in done}
    prepare([str(corpus)], tok, out, shard_tokens=8_000, progress=False)
    assert _shard_bytes(out) == _shard_bytes(ref)
    assert not list(out.glob("*.tmp*"))
    assert {n: (out / f"{n}.bin").stat().st_mtime_ns for n in finished} == finished  # not redone
    m_ref, m_out = (json.loads((d / "manifest.json").read_text()) for d in (ref, out))
    assert m_ref["shards"] == m_out["shards"] and m_ref["num_tokens"] == m_out["num_tokens"]


# ---- bad input: clear errors naming the file and the fix, before expensive work -------------


def test_missing_input_file(tmp_path, tok):
    with pytest.raises(DataError, match=r"nope\.txt does not exist"):
        prepare([str(tmp_path / "nope.txt")], tok, tmp_path / "o", progress=False)
    with pytest.raises(DataError, match="matches no files"):
        prepare([str(tmp_path / "*.txt")], tok, tmp_path / "o", progress=False)


def test_empty_input_file(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"empty\.txt is empty\. Fix: remove it"):
        prepare([str(tmp_path / "empty.txt")], tok, tmp_path / "o", progress=False)
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    with pytest.raises(DataError, match="no non-empty documents"):
        prepare([str(tmp_path / "blank.txt")], tok, tmp_path / "o2", progress=False)


def test_missing_tokenizer(tmp_path, corpus):
    with pytest.raises(DataError, match="does not exist. Fix: train one with"):
        prepare([str(corpus)], tmp_path / "no_tok", tmp_path / "o", progress=False)


def test_tokenizer_train_rejects_bad_input(tmp_path):
    from data_pipeline.tokenizer import train_sentencepiece

    with pytest.raises(DataError, match="does not exist"):
        train_sentencepiece([str(tmp_path / "x.txt")], 500, tmp_path / "t")
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(DataError, match="e.txt is empty"):
        train_sentencepiece([str(tmp_path / "e.txt")], 500, tmp_path / "t")


def _small_alphabet_text(path: Path) -> Path:
    """A few lines over 270 distinct characters (Latin, Greek, Cyrillic), each of them frequent enough
    that character_coverage keeps every one: SentencePiece then needs 271 character pieces (with the
    whitespace marker) + 260 special/byte pieces, and BPE runs out of merges a few hundred pieces later."""
    chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(0x391, 0x3CA) if c != 0x3A2]
    chars = (chars + [chr(c) for c in range(0x410, 0x410 + 120)])[:270]
    rng = np.random.default_rng(0)
    lines = [" ".join("".join(rng.choice(chars, rng.integers(1, 7))) for _ in range(8)) for _ in range(3)]
    return write_text(path, lines + [" ".join(chars)])


def _train_cli(src: Path, vocab: int, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "data_pipeline.tokenizer",
            "train",
            "--input",
            str(src),
            "--vocab-size",
            str(vocab),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
    )


def test_tokenizer_vocab_range_from_data(tmp_path):
    """Too small and too large --vocab-size both name the valid range computed from the data; both ends
    of that range train (and one past either end does not)."""
    src = _small_alphabet_text(tmp_path / "alphabet.txt")
    assert len(set(src.read_text()) - {" ", "\n"}) == 270
    r = _train_cli(src, 300, tmp_path / "low")
    assert r.returncode == 2 and not (tmp_path / "low" / "tokenizer.model").exists()
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: ") and "Fix:" in err and "Traceback" not in r.stderr
    low, high = map(int, re.search(r"valid range is \[(\d+), (\d+)\]", err).groups())
    assert low == 270 + 1 + 260 and high > low + 100
    assert "too small" in err and "raise --vocab-size" not in err
    for vocab in (low - 1, high + 1, 8000):
        r = _train_cli(src, vocab, tmp_path / f"bad{vocab}")
        err = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and f"valid range is [{low}, {high}]" in err and "Fix:" in err, r.stderr
        assert ("too small" if vocab < low else "too large") in err
        assert not (tmp_path / f"bad{vocab}" / "tokenizer.model").exists()
        assert not list((tmp_path / f"bad{vocab}").glob("tokenizer.tmp*"))
    for vocab in (low, (low + high) // 2, high):
        r = _train_cli(src, vocab, tmp_path / f"ok{vocab}")
        assert r.returncode == 0, r.stderr
        assert load_tokenizer(tmp_path / f"ok{vocab}").vocab_size == vocab


def test_hf_dataset_offline_names_local_alternative(tmp_path, tok):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_pipeline.prepare",
            "--source",
            "hf:someone/not-a-real-dataset",
            "--tokenizer",
            str(tok),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2
    assert "someone/not-a-real-dataset" in r.stderr and "pass local files" in r.stderr and "--source" in r.stderr
    assert not (tmp_path / "o").exists()


def test_rerun_with_different_settings_is_refused(tmp_path, tok, corpus):
    prepare([str(corpus)], tok, tmp_path / "o", shard_tokens=50_000, progress=False)
    with pytest.raises(DataError, match="different prepare run.*new --out"):
        prepare([str(corpus)], tok, tmp_path / "o", shard_tokens=10_000, progress=False)


def test_uint32_for_large_vocab():
    from data_pipeline.shards import dtype_for_vocab

    assert dtype_for_vocab(65536) == np.uint16 and dtype_for_vocab(128_256) == np.uint32


def test_read_manifest_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist. Fix: create it with"):
        read_manifest(tmp_path / "nothing")
    with pytest.raises(DataError, match="not a prepared shard directory"):
        read_manifest(tmp_path)


def test_hf_streaming_from_a_local_dataset_directory(tmp_path, tok):
    """hf:DIR goes through datasets' streaming mode; the shards equal those of the same records
    prepared from a plain file, and hold exactly the non-streamed dataset's records."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = corpus_lines(900)
    ds_dir = tmp_path / "my_dataset"
    (ds_dir / "data").mkdir(parents=True)
    for i, part in enumerate((lines[:500], ["  "] + lines[500:])):  # two files; a whitespace doc
        pq.write_table(
            pa.table({"text": part, "n": list(range(len(part)))}), ds_dir / "data" / f"train-0000{i}-of-00002.parquet"
        )
    streamed = prepare([f"hf:{ds_dir}"], tok, tmp_path / "streamed", shard_tokens=9_000, progress=False)
    assert streamed["config"]["source"] == {"hf": [str(ds_dir), None, "train"]}
    records = datasets.load_dataset(str(ds_dir), split="train")  # not streamed: Arrow in memory
    assert not isinstance(records, datasets.IterableDataset) and records.num_rows == 901
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in records["text"]))
    plain = prepare([str(tmp_path / "same.jsonl")], tok, tmp_path / "plain", shard_tokens=9_000, progress=False)
    assert _shard_bytes(tmp_path / "streamed") == _shard_bytes(tmp_path / "plain")
    assert streamed["shards"] == plain["shards"] and len(streamed["shards"]) >= 2
    t = load_tokenizer(tok)
    expect = [i for text in records["text"] if text.strip() for i in t.encode(text) + [t.eos_id]]
    assert ShardSet(tmp_path / "streamed").read(0, streamed["num_tokens"]).tolist() == expect
    assert streamed["num_docs"] == 900 and streamed["source_docs"] == 901
