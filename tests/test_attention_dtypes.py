"""RoPE in the activations' dtype and GQA without K/V copies: each against its plain reference (the fp32 or
float64 rotation; the K/V heads repeated), forward and backward, and RoPE against transformers' Llama."""

import pytest
import torch
from fixtures import OpDtypes
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from model import preset
from model.hf_format import llama_config_fields
from model.kernels import select
from model.layers import SoftmaxAttention, apply_rope, rope_cos_sin
from model.transformer import doc_positions_and_mask


def test_rope_rotates_bf16_without_an_fp32_copy_within_bf16_rounding_of_float64():
    cfg = preset("tiny", max_seq_len=64, rope_theta=500000.0)
    torch.manual_seed(0)
    x = torch.randn(2, cfg.num_heads, 64, cfg.head_dim)
    pos = torch.arange(64)
    cos64, sin64 = (c.double() for c in rope_cos_sin(cfg, pos))  # fp32 angles, as the model computes them
    ref = apply_rope(x.to(torch.bfloat16).double(), cos64, sin64)
    cos, sin = rope_cos_sin(cfg, pos, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    with OpDtypes() as ops:
        got = apply_rope(x.to(torch.bfloat16), cos, sin)
    assert got.dtype == torch.bfloat16
    assert all(dtype == torch.bfloat16 for _, dtype, _ in ops.seen), ops.seen  # no fp32 round trip
    # three roundings (the tables, the products, the sum) of at most 2^-8 (bf16 unit roundoff) each, relative
    # to the terms' magnitudes
    xb = x.to(torch.bfloat16).double()
    half = cfg.head_dim // 2
    scale = xb.abs() * cos64.abs() + torch.cat((xb[..., half:], xb[..., :half]), -1).abs() * sin64.abs()
    err = (got.double() - ref).abs()
    assert (err <= 3 * 2**-8 * scale).all(), (err / scale).max()
    assert (err / scale).max() > 0  # and it is not the fp32 path by accident
    # fp32 activations rotate exactly as before (fp32 tables, fp32 products)
    cos32, sin32 = rope_cos_sin(cfg, pos)
    torch.testing.assert_close(apply_rope(x, cos32, sin32), apply_rope(x.double(), cos64, sin64).float())


def test_rope_in_bf16_is_bitwise_transformers_llama():
    """The tables and the rotation are HF's, bit for bit, in bf16 (its rotary embedding casts cos/sin to the
    activations' dtype and rotates there)."""
    cfg = preset("tiny", vocab_size=64, max_seq_len=32, num_kv_heads=2, rope_theta=500000.0)
    hf = LlamaRotaryEmbedding(LlamaConfig(**llama_config_fields(cfg)))
    torch.manual_seed(1)
    q = torch.randn(2, cfg.num_heads, 32, cfg.head_dim, dtype=torch.bfloat16)
    k = torch.randn(2, cfg.num_kv_heads, 32, cfg.head_dim, dtype=torch.bfloat16)
    pos = torch.arange(32)
    hf_cos, hf_sin = hf(q, pos[None])
    cos, sin = rope_cos_sin(cfg, pos, torch.bfloat16)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    assert torch.equal(apply_rope(q, cos, sin), hf_q) and torch.equal(apply_rope(k, cos, sin), hf_k)


def _attention(groups_native: bool, monkeypatch, cfg, x, doc_ids=None):
    monkeypatch.setattr("model.layers.sdpa_native_gqa", lambda q, mask: groups_native)
    attn = SoftmaxAttention(cfg, 0).to(x.dtype)
    torch.manual_seed(2)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = x.clone().requires_grad_(True)
    if doc_ids is None:
        pos, mask = torch.arange(x.shape[1]), None
    else:
        pos, mask = doc_positions_and_mask(doc_ids)
    cos, sin = rope_cos_sin(cfg, pos, x.dtype)
    out = attn(x, cos, sin, attn_mask=mask)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in attn.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("docs", [False, True])
def test_gqa_without_kv_copies_equals_repeated_heads_forward_and_backward(monkeypatch, dtype, docs):
    cfg = preset("tiny", vocab_size=64, max_seq_len=16, num_heads=4, num_kv_heads=2)
    torch.manual_seed(3)
    x = torch.randn(2, 16, cfg.hidden_size, dtype=dtype)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 16]) if docs else None
    native = _attention(True, monkeypatch, cfg, x, doc_ids)
    copies = _attention(False, monkeypatch, cfg, x, doc_ids)
    tol = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native[0], copies[0], **tol)
    torch.testing.assert_close(native[1], copies[1], **tol)
    for name in native[2]:
        torch.testing.assert_close(native[2][name], copies[2][name], **tol, msg=name)


def test_gqa_native_sdpa_makes_no_kv_copy(monkeypatch):
    """With the shared heads passed to SDPA, nothing of K/V's repeated size is made in the forward."""
    cfg = preset("tiny", vocab_size=64, max_seq_len=16, num_heads=4, num_kv_heads=1)
    x = torch.randn(2, 16, cfg.hidden_size)
    attn = SoftmaxAttention(cfg, 0)
    cos, sin = rope_cos_sin(cfg, torch.arange(16))
    with OpDtypes() as ops:
        attn(x, cos, sin)
    # repeat_interleave of K/V runs as expand + clone
    assert not [op for op, _, _ in ops.seen if "expand" in op or "clone" in op], ops.seen


def test_native_gqa_rule():
    """CPU: always; CUDA: only the flash kernel's calls (half precision, no mask, head dim <= 256)."""

    class Q:
        def __init__(self, cuda, dtype, dh=64):
            self.is_cuda, self.dtype, self.shape = cuda, dtype, (1, 4, 8, dh)

    mask = torch.ones(1, 8, 8, dtype=torch.bool)
    assert select.sdpa_native_gqa(Q(False, torch.float32), mask)
    assert select.sdpa_native_gqa(Q(True, torch.bfloat16), None)
    assert not select.sdpa_native_gqa(Q(True, torch.bfloat16), mask)
    assert not select.sdpa_native_gqa(Q(True, torch.float32), None)
    assert not select.sdpa_native_gqa(Q(True, torch.float16, 512), None)
