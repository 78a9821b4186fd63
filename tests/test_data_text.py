"""`text:` sources: the byte stream as before, line documents separated by EOS, windows cut at
document boundaries, and the one byte tokenizer every layer uses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.errors import DataError
from data_pipeline.classification import ClassificationLoader
from data_pipeline.config import parse_data
from data_pipeline.text import TextLoader, pack_windows, text_files
from data_pipeline.tokenizer import BYTE_TOKENIZER, load_tokenizer
from eval.perplexity import file_stream

LINES = [
    "cat=meow",
    "dog=woof",
    "",
    "a much longer line that does not fit one window at all",
    "cow=moo  ",
    "   ",
    "owl=hoot\r",
]


def _loader(path, **data):
    split = data.pop("split", "train")
    return TextLoader(parse_data({"source": f"text:{path}", "seed": 0, **data}), split, 16, 4)


def _rows(loader, batches):
    out = []
    for _ in range(batches):
        b = next(loader)
        out += list(zip(b["input_ids"].tolist(), b["labels"].tolist()))
    return out


def test_byte_tokenizer_is_one_identity_with_eos_outside_utf8():
    tok = load_tokenizer("bytes")
    assert tok is BYTE_TOKENIZER and (tok.identity, tok.vocab_size, tok.eos_id) == ("bytes", 256, 255)
    text = "héllo wörld ✓ \x00"
    ids = tok.encode(text)
    assert max(ids) < 255 and bytes(ids) == text.encode("utf-8")  # UTF-8 never uses 0xFF
    assert tok.decode(ids + [tok.eos_id]) == text  # EOS is not text
    assert TextLoader.tokenizer_id == tok.identity and TextLoader.vocab_size == tok.vocab_size


def test_stream_windows_are_consecutive_slices_of_the_bytes(tmp_path):
    f = tmp_path / "t.txt"
    raw = "".join(f"line {i}\n" for i in range(100)).encode()
    f.write_bytes(raw)
    ld = _loader(f, val_fraction=0.0)
    assert ld.n_windows == (len(raw) - 1) // 16
    for x, y in _rows(ld, 5):
        start = raw.find(bytes(x))
        assert start % 16 == 0 and list(raw[start + 1 : start + 17]) == y  # labels: inputs shifted by one


def test_line_documents_end_in_eos_and_windows_hold_whole_documents(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("\n".join(LINES) + "\n")
    docs = [line.rstrip("\r").encode() for line in LINES if line.strip()]
    ld = _loader(f, documents="lines", windows="documents", val_fraction=0.0)
    eos = BYTE_TOKENIZER.eos_id
    assert ld.tokens.tolist() == [t for d in docs for t in [*d, eos]]
    rows = _rows(ld, -(-ld.n_windows // 4))[: ld.n_windows]  # one epoch: every window once
    short = [d for d in docs if len(d) + 1 <= 17]
    long = [d for d in docs if len(d) + 1 > 17]
    found = []
    for x, y in rows:
        n = sum(v != -100 for v in y)
        assert all(v == -100 for v in y[n:]) and all(v == eos for v in x[n + 1 :])  # padding is not scored
        assert x[1:n] == y[: n - 1]
        seq = bytes(x[:n] + [y[n - 1]])
        pieces = seq.split(bytes([eos]))
        if any(p and p not in short for p in pieces[:-1]) or (pieces[-1] and not seq.endswith(bytes([eos]))):
            assert any(seq.rstrip(bytes([eos])) in d for d in long)  # a piece of a long document
        else:
            assert seq.endswith(bytes([eos])) and all(p in short for p in pieces[:-1])  # whole documents
            found += pieces[:-1]
    assert sorted(found) == sorted(short)  # every short document once, never cut


def test_doc_ids_number_the_documents_of_each_window(tmp_path):
    """Windows cut anywhere in the line stream: a position's document id counts the EOS tokens before
    it in its window, so a document (its EOS included) is one run of one id, starting at 0."""
    f = tmp_path / "t.txt"
    f.write_text("".join(f"{i}+{i % 7}={i + i % 7}\n" for i in range(200)))
    eos = BYTE_TOKENIZER.eos_id
    ld = _loader(f, documents="lines", return_doc_ids=True, val_fraction=0.0)
    plain = _loader(f, documents="lines", val_fraction=0.0)
    for _ in range(3):
        b, ref = next(ld), next(plain)
        assert b["input_ids"].equal(ref["input_ids"]) and b["labels"].equal(ref["labels"])  # same windows
        for x, d in zip(b["input_ids"].tolist(), b["doc_ids"].tolist()):
            assert d[0] == 0 and all(0 <= d[i + 1] - d[i] <= 1 for i in range(len(d) - 1))
            for i in range(1, len(x)):
                assert d[i] == d[i - 1] + (x[i - 1] == eos)  # a new document begins right after an EOS


def test_pack_windows_scores_every_target_once():
    lengths = np.array([5, 5, 30, 3, 17, 2, 40])  # a line and its EOS: at least 2 tokens
    span = 17
    spans = pack_windows(lengths, span)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    targets = [t for b, e in spans for t in range(b + 1, e)]
    assert all(1 < e - b <= span for b, e in spans)
    assert len(targets) == len(set(targets))  # no target twice
    window_starts = {int(b) for b, _ in spans if b in set(starts.tolist())}
    assert set(targets) == set(range(int(ends[-1]))) - window_starts  # all others once
    for s, e in zip(starts, ends):
        if e - s <= span:  # a short doc is in one window
            assert any(b <= s and e <= w for b, w in spans)


def test_validation_is_the_tail_of_the_lines(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("".join(f"{i:03d}=x{i % 7}\n" for i in range(100)))
    tr = _loader(f, documents="lines", val_fraction=0.1)
    va = TextLoader(parse_data({"source": f"text:{f}", "documents": "lines", "val_fraction": 0.1}), "val", 16, 4)
    assert bytes(va.tokens[:6]) == b"090=x6" and bytes(tr.tokens[-7:-1]) == b"089=x5"


def test_resume_continues_the_order_and_refuses_other_settings(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("".join(f"{i:03d}=y\n" for i in range(200)))
    a = _loader(f, documents="lines", windows="documents")
    _rows(a, 3)
    b = _loader(f, documents="lines", windows="documents")
    b.load_state_dict(a.state_dict())
    assert _rows(a, 2) == _rows(b, 2)
    c = _loader(f, documents="lines")
    with pytest.raises(DataError, match="Fix: resume with the same data settings"):
        c.load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "data,msg",
    [
        ({"windows": "documents"}, "needs document boundaries"),
        ({"documents": "paragraphs"}, "data.documents"),
        ({"shuffle": True}, "unknown keys"),
        ({"return_doc_ids": True}, "return_doc_ids needs document boundaries"),
        ({"documents": "lines", "return_doc_ids": "yes"}, "must be true or false"),
    ],
)
def test_bad_settings_are_refused(tmp_path, data, msg):
    f = tmp_path / "t.txt"
    f.write_text("x=1\n" * 100)
    with pytest.raises(DataError, match=msg):
        _loader(f, **data)


def test_non_utf8_text_is_refused(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\u00e9 \u00ff\n".encode("latin-1") * 50)
    with pytest.raises(DataError, match="0xFF.*not UTF-8.*Fix"):
        _loader(f)


def test_classification_uses_the_same_byte_tokenizer_and_keeps_pad_zero(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text("".join('{"text": "h\\u00e9\\u0000y", "label": %d}\n' % (i % 2) for i in range(20)))
    ld = ClassificationLoader(parse_data({"source": f"classify:{f}", "tokenizer": "bytes"}), "train", 8, 4)
    assert (ld.tokenizer_id, ld.vocab_size, ld.pad_id) == ("bytes", 256, 0)
    assert ld.input_ids[0].tolist() == [*"hé".encode(), ord("y"), 0, 0, 0, 0]  # NUL dropped, 0-padded


def test_jsonl_records_are_the_text(tmp_path):
    """A .jsonl file (data/sample's format): the stream is its texts joined by blank lines; as
    documents, every record (newlines and all) is one document ending in EOS; eval's --text reads it too."""
    texts = ["first doc\nwith two lines", "second", "   ", "third one"]
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"id": i, "source": "x", "text": t}) + "\n" for i, t in enumerate(texts)))
    stream = _loader(f, val_fraction=0.0)
    assert bytes(stream.tokens.tolist()) == "\n\n".join(texts).encode()
    docs = _loader(f, documents="lines", val_fraction=0.0)
    eos = BYTE_TOKENIZER.eos_id
    assert docs.tokens.tolist() == [
        t for d in ("first doc\nwith two lines", "second", "third one") for t in [*d.encode(), eos]
    ]
    toks, n_bytes = file_stream(f, BYTE_TOKENIZER)
    assert n_bytes == len("\n\n".join(texts).encode())
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(DataError, match=r'bad.jsonl:1: expected a JSON object with a string "text"'):
        _loader(tmp_path / "bad.jsonl")


def test_hub_source_is_the_splits_text_written_once(tmp_path, monkeypatch):
    """`text:hf:` through the real `datasets` loader (a local dataset folder: no network here): each split
    comes back as the lines it was made of, in the order named, cached, and trains like a local file."""
    monkeypatch.setenv("DATA_PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "validation.txt").write_text(" = A =\n\n line one\n cat=meow\n" * 8)
    (ds / "test.txt").write_text(" line t\n")
    source = f"hf:{ds}::test+validation"
    files = text_files(f"text:{source}")
    assert [f.read_text() for f in files] == [" line t\n", " = A =\n\n line one\n cat=meow\n" * 8]
    (ds / "test.txt").write_text("changed\n")  # the cache answers; the dataset is not read again
    assert text_files(f"text:{source}") == files and files[0].read_text() == " line t\n"
    local = tmp_path / "local.txt"
    local.write_text("".join(f.read_text() for f in files))
    assert _rows(_loader(source), 2) == _rows(_loader(local), 2)


def test_hub_source_that_cannot_load_is_one_line_with_the_local_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_PIPELINE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"could not load 'no-such/dataset'.*Fix: .*data.source=text:") as e:
        text_files("text:hf:no-such/dataset:cfg:validation")
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "cache").rglob("*.txt"))  # nothing half-written is left to be read as data
