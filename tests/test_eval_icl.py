"""The in-context learning score (eval/in_context.py): the per-position loss equals a plain
per-window reference, the bands sit where Olsson et al. put them, a model that reads its
context scores negative, and `eval.run --tasks icl` reports it on a text file."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.errors import EvalError
from data_pipeline.tokenizer import ByteTokenizer
from eval.in_context import bands, icl_score, loss_by_position
from eval.run import EvalOptions, evaluate_model
from model import preset
from model.transformer import build_model

torch.set_num_threads(1)


def test_loss_by_position_matches_a_per_window_reference():
    model = build_model(preset("tiny", vocab_size=40, max_seq_len=24), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 40, (5 * 17 + 6,), generator=g)
    got = loss_by_position(model, tokens, window=17, n_windows=5, batch_size=2)
    ref = torch.zeros(16, dtype=torch.float64)
    with torch.no_grad():
        for w in range(5):  # windows are consecutive slices from the first token
            x = tokens[w * 17 : (w + 1) * 17]
            logits = model(x[None, :-1])[0].double()
            ref += F.cross_entropy(logits, x[1:], reduction="none")
    torch.testing.assert_close(got, ref / 5, rtol=1e-5, atol=1e-6)


def test_bands_follow_olsson_positions():
    assert bands(513) == ((34, 66), (485, 512))  # tokens 50 and 500 of a 512-token context, +-16
    assert bands(257) == ((17, 33), (243, 256))
    with pytest.raises(EvalError, match="too short"):
        bands(4)


class PeriodCopier(nn.Module):
    """A model that has learnt the stream's period P: it predicts token t-P once it has seen it, and
    nothing (uniform) before; its loss is log V early in a window and ~0 late."""

    def __init__(self, vocab: int, period: int, max_seq_len: int):
        super().__init__()
        self.cfg = preset("tiny", vocab_size=vocab, max_seq_len=max_seq_len)
        self.period = period
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        b, t = x.shape
        logits = torch.zeros(b, t, self.cfg.vocab_size)
        for i in range(self.period - 1, t):
            logits[torch.arange(b), i, x[:, i + 1 - self.period]] = 50.0
        return logits


def test_a_model_that_reads_its_context_scores_negative():
    V, P = 16, 40
    stream = torch.randint(0, V, (P,), generator=torch.Generator().manual_seed(0)).repeat(40)
    res = icl_score(PeriodCopier(V, P, 128), stream, n_windows=8)
    assert res["window"] == 129 and res["windows"] == 8
    assert res["early_tokens"] == [9, 17] and res["late_tokens"] == [122, 128]
    assert abs(res["early_loss"] - math.log(V)) < 1e-4 and res["late_loss"] < 1e-4
    assert abs(res["icl_score"] + math.log(V)) < 1e-3


def test_eval_run_reports_icl_on_a_text_file(tmp_path):
    text = tmp_path / "val.txt"
    text.write_text("The river runs past the old mill and under the stone bridge before it reaches the sea. " * 20)
    model = build_model(preset("tiny", vocab_size=256, max_seq_len=64), seed=0).eval()
    res = evaluate_model(
        model, {"tokenizer_id": ByteTokenizer().identity}, ["icl"], EvalOptions(tokenizer="bytes", text=str(text), n=4)
    )
    icl = res["tasks"]["icl"]
    assert icl["windows"] == 4 and icl["window"] == 65 and len(icl["loss_by_position"]) == 64
    assert math.isclose(icl["icl_score"], icl["late_loss"] - icl["early_loss"])
    assert res["metrics"]["icl/icl_score"] == icl["icl_score"]
    with pytest.raises(EvalError, match="--text FILE or --val-dir"):
        evaluate_model(model, {"tokenizer_id": ByteTokenizer().identity}, ["icl"], EvalOptions(tokenizer="bytes"))
