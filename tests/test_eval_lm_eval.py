"""lm-eval adapter: loglikelihood vs a hand computation, rolling vs perplexity, an offline task end to end."""

import math

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from data_pipeline.tokenizer import ByteTokenizer
from eval.lm_eval_adapter import TrainablePartsLM, offline_tasks, run_lm_eval
from eval.perplexity import perplexity
from model import preset
from model.transformer import build_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    model = build_model(preset("tiny", variant="standard", vocab_size=257, max_seq_len=64), seed=2).eval()
    return TrainablePartsLM(model, ByteTokenizer(), batch_size=3)


def req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def test_loglikelihood_matches_hand_computation(lm):
    pairs = [
        ("The sky is", " blue"),
        ("a=1, b=2. b=", "2"),
        ("xy", "z and more"),
        ("", "hello"),
        ("Q" * 80, " tail"),
    ]  # the last one is truncated on the left to fit max_seq_len
    got = lm.loglikelihood([req("loglikelihood", p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        c = [lm.tokenizer.eos_id] if ctx == "" else list(ctx.encode())
        y = list(cont.encode())
        full = (c + y)[-65:]  # at most max_seq_len inputs + 1
        x = torch.tensor(full[:-1])[None]
        with torch.no_grad():
            logp = F.log_softmax(lm.model(x)[0].float(), -1)
        n = len(full) - 1
        # hand slicing: token full[k] is predicted by logit row k-1
        want = sum(float(logp[k - 1, full[k]]) for k in range(n + 1 - len(y), n + 1))
        assert ll == pytest.approx(want, abs=1e-4)
        assert greedy == all(int(logp[k - 1].argmax()) == full[k] for k in range(n + 1 - len(y), n + 1))


def test_rolling_equals_perplexity_sum(lm):
    text = "abcdefghij" * 15
    (ll,) = lm.loglikelihood_rolling([req("loglikelihood_rolling", (text,))], disable_tqdm=True)
    ids = [lm.tokenizer.eos_id] + list(text.encode())
    p = perplexity(lm.model, ids, window=65, stride=64, progress=False)
    assert p["tokens"] == len(text)
    assert -ll == pytest.approx(p["loss"] * p["tokens"], rel=1e-5)


def test_generate_until_stops(lm):
    (out,) = lm.generate_until(
        [req("generate_until", ("hello", {"until": ["\n"], "max_gen_toks": 5}))], disable_tqdm=True
    )
    assert isinstance(out, str) and "\n" not in out


def test_offline_task_runs_without_network(lm, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert {"tp_kv_recall", "tp_passkey", "tp_text"} <= set(offline_tasks())
    res = run_lm_eval(lm, ["tp_kv_recall", "tp_text"], limit=4)
    assert 0.0 <= res["tp_kv_recall"]["acc"] <= 1.0
    assert math.isfinite(res["tp_text"]["bits_per_byte"]) and res["tp_text"]["bits_per_byte"] > 0
