"""Perplexity: window coverage, and eval.run on a native checkpoint == LlamaForCausalLM on its HF export."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.tokenizer import ByteTokenizer
from eval.perplexity import perplexity, window_spans
from model import preset
from model.hf import export_hf
from model.io import save_native
from model.transformer import build_model

torch.set_num_threads(1)

TEXT = (
    "The river runs past the old mill and under the stone bridge before it reaches the sea. "
    "In the morning the market fills with people buying bread, fruit and fresh fish. "
) * 3


@pytest.mark.parametrize("n,w,s", [(10, 4, 2), (100, 16, 15), (100, 16, 5), (7, 32, 8), (33, 8, 1)])
def test_windows_score_every_token_once(n, w, s):
    scored = []
    for b, e, first in window_spans(n, w, s):
        assert e - b == min(w, n) and b < first <= e
        scored += list(range(first, e))
        if first > b + 1:
            assert first - b >= min(w - s, first)  # each scored token keeps >= w - s context
    assert scored == list(range(1, n))


def test_bad_stride_is_an_error():
    from common.errors import EvalError

    with pytest.raises(EvalError, match="stride"):
        window_spans(100, 16, 16)


def hf_sliding_window_nll(hf, ids, window, stride):
    """The strided evaluation of the transformers docs, written independently."""
    ids = torch.tensor(ids)[None]
    n = ids.shape[1]
    nll, count, prev_end, begin = 0.0, 0, 0, 0
    while True:
        begin = min(begin, max(0, n - window))  # last window ends at the stream's end, full length
        end = min(begin + window, n)
        trg = end - max(prev_end, 1) if begin == 0 else end - prev_end
        x = ids[:, begin:end]
        with torch.no_grad():
            logits = hf(x).logits[:, :-1].float()
        lp = F.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[0, :, 0].double()
        nll -= float(lp[-trg:].sum())
        count += trg
        prev_end = end
        if end == n:
            return nll, count
        begin += stride


def test_run_perplexity_matches_hf_llama(tmp_path):
    from transformers import LlamaForCausalLM

    from eval.run import main

    tok = ByteTokenizer()
    model = build_model(preset("tiny", variant="standard", vocab_size=tok.vocab_size, max_seq_len=64), seed=3)
    save_native(model, tmp_path / "native", {"step": 7, "tokens_seen": 700, "tokenizer_id": tok.identity})
    export_hf(model, tmp_path / "hf")
    (tmp_path / "val.txt").write_text(TEXT)
    out = tmp_path / "res.json"
    rc = main(
        [
            "--checkpoint",
            str(tmp_path / "native"),
            "--tasks",
            "perplexity",
            "--text",
            str(tmp_path / "val.txt"),
            "--tokenizer",
            "bytes",
            "--window",
            "48",
            "--stride",
            "20",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    ck = res["checkpoint"]
    assert (ck["step"], ck["tokens_seen"], ck["variant"], ck["tokenizer_id"]) == (7, 700, "standard", tok.identity)
    p = res["tasks"]["perplexity"]

    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = [tok.eos_id] + tok.encode(TEXT)
    nll, count = hf_sliding_window_nll(hf, ids, 48, 20)
    assert p["tokens"] == count == len(TEXT.encode())
    assert p["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert p["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert p["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(TEXT.encode()), rel=1e-5)

    # the HF export is itself an accepted checkpoint and gives the same number
    from eval.run import evaluate_checkpoint

    r = evaluate_checkpoint(
        tmp_path / "hf",
        ["perplexity"],
        tokenizer="bytes",
        text=str(tmp_path / "val.txt"),
        window=48,
        stride=20,
        progress=False,
    )
    assert r["tasks"]["perplexity"]["loss"] == pytest.approx(p["loss"], rel=1e-6)


def test_batching_does_not_change_numbers():
    model = build_model(preset("tiny", variant="mixit", vocab_size=50, max_seq_len=32), seed=0).eval()
    ids = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    a = perplexity(model, ids, window=32, stride=16, batch_size=1, progress=False)
    b = perplexity(model, ids, window=32, stride=16, batch_size=7, progress=False)
    assert a["tokens"] == b["tokens"] == 299
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
