"""Shaped attention (Noci et al.): A = I + softmax(Q K^T / tau) - C, in every mode."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from model import preset
from model.hf import export_hf
from model.hf_format import import_hf
from model.layers import apply_rope, rope_cos_sin
from model.transformer import build_model

V, T = 61, 16


def shaped_cfg(**kw):
    return preset("tiny", variant="shaped", vocab_size=V, max_seq_len=T, **kw)


def explicit_matrix(attn, x, causal):
    """A per head, built from the definition with the module's own projections (float64)."""
    cfg = attn.cfg
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    cos, sin = rope_cos_sin(cfg, torch.arange(t))
    q, k = apply_rope(q, cos, sin).double(), apply_rope(k, cos, sin).double()
    k = k.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)
    tau = cfg.shaped_tau0 * math.sqrt(cfg.head_dim) * (cfg.hidden_size / cfg.shaped_width_base)
    scores = q @ k.transpose(-1, -2) / tau
    vis = torch.ones(t, t, dtype=torch.bool).tril() if causal else torch.ones(t, t, dtype=torch.bool)
    probs = scores.masked_fill(~vis, float("-inf")).softmax(-1)
    center = vis.double() / vis.double().sum(-1, keepdim=True)
    return torch.eye(t, dtype=torch.float64) + probs - center, vis


@pytest.mark.parametrize("causal", [True, False])
def test_output_is_explicit_A_times_V(causal):
    cfg = shaped_cfg(causal=causal, num_kv_heads=2)
    attn = build_model(cfg, seed=0).layers[0].self_attn.eval()
    x = torch.randn(2, T, cfg.hidden_size)
    with torch.no_grad():
        a, vis = explicit_matrix(attn, x, causal)
        # rows of A - I sum to zero over the visible part; nothing outside it
        torch.testing.assert_close(
            (a - torch.eye(T, dtype=torch.float64)).sum(-1),
            torch.zeros(2, cfg.num_heads, T, dtype=torch.float64),
            rtol=0,
            atol=1e-12,
        )
        assert torch.all(a[..., ~vis] == 0)
        v = attn.v_proj(x).view(2, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2).double()
        v = v.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)
        want = (a @ v).transpose(1, 2).reshape(2, T, -1) @ attn.o_proj.weight.double().T
        cos, sin = rope_cos_sin(cfg, torch.arange(T))
        got = attn(x, cos, sin)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_temperature_formula():
    cfg = shaped_cfg(shaped_tau0=2.0, shaped_width_base=32)
    assert math.isclose(cfg.attn_scale, 1 / (2.0 * math.sqrt(cfg.head_dim) * (64 / 32)))
    assert math.isclose(preset("tiny").attn_scale, 1 / math.sqrt(16))


def test_eager_and_sdpa_agree():
    x = torch.randint(0, V, (2, T))
    a = build_model(shaped_cfg(attn_impl="eager"), seed=0).eval()
    b = build_model(shaped_cfg(attn_impl="sdpa"), seed=0).eval()
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


def test_round_trip_through_registered_class(tmp_path):
    model = build_model(shaped_cfg(), seed=0).eval()
    export_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "TrainablePartsForCausalLM"
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        assert torch.equal(model(x), hf(x).logits)
        assert torch.equal(model(x), import_hf(tmp_path).eval()(x))
