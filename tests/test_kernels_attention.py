"""Softmax-attention backend selection (CPU: the rule and the SDPA fallback; GPU: flash parity)."""

import logging

import pytest
import torch

from model import preset
from model.kernels import select
from model.kernels.flash import flash_available, segments_from_mask
from model.transformer import build_model, doc_positions_and_mask

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def q_(device="cpu", dtype=torch.float32):
    return torch.zeros(1, 2, 4, 8, device=device, dtype=dtype)


def test_selection_rule_on_cpu():
    mask = torch.ones(1, 4, 4, dtype=torch.bool)
    assert select.attention_backend("auto", q_(), None, 0)[0] == "sdpa"
    assert select.attention_backend("auto", q_(dtype=torch.bfloat16), None, 0) == ("sdpa", "not on CUDA")
    assert select.attention_backend("auto", q_(), None, 0, record_attn=True)[0] == "eager"
    assert select.attention_backend("eager", q_(), None, 0)[0] == "eager"
    assert select.attention_backend("sdpa", q_(), mask, 3)[0] == "sdpa"
    assert select.attention_backend("flash", q_(), None, 0)[0] == "flash"
    assert select.attention_backend("flash", q_(), mask, 0)[0] == "flash_varlen"


def test_selection_rule_on_cuda_without_running_it(monkeypatch):
    """The CUDA branches, with a stand-in tensor whose is_cuda is True (nothing is executed)."""

    class FakeQ:
        is_cuda = True
        dtype = torch.bfloat16

    monkeypatch.setattr(select, "flash_available", lambda: True)
    assert select.attention_backend("auto", FakeQ(), None, 0)[0] == "flash"
    assert select.attention_backend("auto", FakeQ(), torch.ones(1, 4, 4, dtype=torch.bool), 0)[0] == "flash_varlen"
    assert select.attention_backend("auto", FakeQ(), None, 5)[0] == "sdpa"  # KV cache
    FakeQ.dtype = torch.float32
    assert select.attention_backend("auto", FakeQ(), None, 0)[0] == "sdpa"  # fp32
    FakeQ.dtype = torch.bfloat16
    monkeypatch.setattr(select, "flash_available", lambda: False)
    assert select.attention_backend("auto", FakeQ(), None, 0) == ("sdpa", "flash-attn not installed")


def test_choice_is_logged_once(caplog):
    select._logged.clear()
    model = build_model(preset("tiny", vocab_size=50, max_seq_len=16), seed=0)
    x = torch.randint(0, 50, (1, 16))
    with caplog.at_level(logging.INFO, logger="model.kernels"):
        model(x)
        model(x)
    lines = [r.getMessage() for r in caplog.records if r.name == "model.kernels"]
    assert lines == ["attention backend: sdpa (not on CUDA)"]


def test_sdpa_fallback_equals_eager():
    x = torch.randint(0, 50, (2, 16))
    docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    outs = []
    for impl in ("eager", "auto"):
        model = build_model(preset("tiny", vocab_size=50, max_seq_len=16, attn_impl=impl), seed=0).eval()
        with torch.no_grad():
            outs.append((model(x), model(x, doc_ids=docs)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_segments_from_document_mask():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    _, mask = doc_positions_and_mask(docs)
    assert segments_from_mask(mask).tolist() == [0, 3, 5, 6, 12]
    _, mask = doc_positions_and_mask(torch.tensor([[0, 1, 0, 1]]))  # ids reused: not contiguous
    assert segments_from_mask(mask) is None


def test_flash_unavailable_on_cpu_only_machine():
    if not torch.cuda.is_available():
        assert flash_available() is False


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("docs", [False, True])
def test_flash_equals_plain_path_on_gpu(docs):
    if not flash_available():
        pytest.skip("flash-attn not installed")
    x = torch.randint(0, 50, (2, 64), device="cuda")
    doc_ids = torch.tensor([[0] * 20 + [1] * 44, [0] * 64], device="cuda") if docs else None
    outs = []
    for impl in ("sdpa", "flash"):
        model = build_model(preset("s", vocab_size=50, max_seq_len=64, attn_impl=impl), seed=0, device="cuda")
        model = model.to(torch.bfloat16).eval()
        with torch.no_grad():
            outs.append(model(x, doc_ids=doc_ids).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=3e-2, atol=3e-2)
