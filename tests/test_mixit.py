"""MixiT's mixing matrix against VARIANTS.md, and the RNG that defines it."""

import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from common.errors import ConfigError
from model import ModelConfig, mixit, preset, rng
from model.io import check_compatible, load_native, save_native
from model.mixit import head_sigmas, mixing_matrix
from model.transformer import build_model

T = 32


def cfg_(**kw):
    base = dict(variant="mixit", vocab_size=50, max_seq_len=T)
    return preset("tiny", **{**base, **kw})


def reference_matrix(cfg, layer, t):
    """Straight from the formulas, in float64 with explicit loops (independent of model/mixit.py)."""
    T_, dh, H = cfg.max_seq_len, cfg.head_dim, cfg.num_heads
    out = torch.zeros(H, t, t, dtype=torch.float64)
    for h in range(H):
        key = rng.mixit_key(cfg.mixit_seed, layer, h)
        if h == 0:
            for i in range(t):
                out[0, i, i] = 0.5
                out[0, i, 0] = 0.5
            continue
        if cfg.mixit_depth_alpha == 0:
            u = float(rng.uniform(key, torch.tensor([0]))[0])
            sigma = 1 / math.sqrt(T_ * dh) + u * (1 / math.sqrt(T_) - 1 / math.sqrt(T_ * dh))
        else:
            sigma = 1 / math.sqrt(T_)
        z = rng.randn(key, torch.arange(T_ * T_)).double().view(T_, T_)
        for i in range(t):
            cols = range(i + 1) if cfg.causal else range(t)
            m = [sigma * float(z[i, j]) for j in cols]
            drift = sum(m) / len(m)
            for j, mij in zip(cols, m):
                identity = 1.0 if (i == j and cfg.mixit_depth_alpha == 0) else 0.0
                out[h, i, j] = identity + cfg.mixit_beta * (mij - drift)
    return out


@pytest.mark.parametrize(
    "kw", [{}, {"mixit_beta": 0.7, "mixit_seed": 9}, {"mixit_depth_alpha": 1.0}, {"causal": False}]
)
def test_matrix_equals_reference_from_formulas(kw):
    cfg = cfg_(**kw)
    t = T if not cfg.causal else 20
    for layer in range(cfg.num_layers):
        got = mixing_matrix(cfg, layer, t).double()
        torch.testing.assert_close(got, reference_matrix(cfg, layer, t), rtol=0, atol=1e-6)


def test_rows_sum_to_one_and_sink_head():
    cfg = cfg_()
    a = mixing_matrix(cfg, 1).double()
    torch.testing.assert_close(a[1:].sum(-1), torch.ones(cfg.num_heads - 1, T, dtype=torch.float64), rtol=0, atol=1e-5)
    assert torch.equal(a[1:], a[1:].tril())  # causal
    sink = torch.zeros(T, T, dtype=torch.float64)
    sink[range(T), range(T)] = 0.5
    sink[:, 0] = 0.5
    assert torch.equal(a[0], sink)  # row 0 is A[0,0] = 1/2


def test_bidirectional_rows_sum_to_one_at_any_length():
    cfg = cfg_(causal=False)
    for t in (T, 11):
        a = mixing_matrix(cfg, 0, t).double()
        torch.testing.assert_close(
            a[1:].sum(-1), torch.ones(cfg.num_heads - 1, t, dtype=torch.float64), rtol=0, atol=1e-5
        )


def test_sigma_interpolates_per_head():
    cfg = cfg_()
    s = head_sigmas(cfg, 0)
    lo, hi = 1 / math.sqrt(T * cfg.head_dim), 1 / math.sqrt(T)
    assert ((s >= lo) & (s <= hi)).all() and len(set(s.tolist())) == cfg.num_heads


def test_prefix_consistency():
    cfg = cfg_()
    full = mixing_matrix(cfg, 0)
    for t in (1, 5, 17):
        # the same numbers; only the summation order of the row means may differ
        torch.testing.assert_close(mixing_matrix(cfg, 0, t), full[:, :t, :t], rtol=0, atol=1e-7)


@pytest.mark.parametrize("kw", [{}, {"causal": False}, {"mixit_depth_alpha": 1.0}])
def test_matrix_built_in_row_blocks_is_the_one_block_matrix(kw, monkeypatch):
    """Built a few rows at a time (as a long T is, to bound the generator's temporaries) the matrix
    is exactly the one built in one block; stored in bf16 it is that matrix rounded."""
    cfg = cfg_(**kw)
    whole = mixing_matrix(cfg, 1)
    monkeypatch.setattr(mixit, "BUILD_BLOCK_ENTRIES", 3 * cfg.max_seq_len)  # 3 rows a block
    assert torch.equal(mixing_matrix(cfg, 1), whole)
    assert torch.equal(mixing_matrix(cfg, 1, dtype=torch.bfloat16), whole.to(torch.bfloat16))


def test_same_seed_same_matrix_different_elsewhere():
    a = mixing_matrix(cfg_(), 0)
    assert torch.equal(a, mixing_matrix(cfg_(), 0))
    assert not torch.allclose(a[1:], mixing_matrix(cfg_(), 1)[1:])  # layers differ
    assert not torch.allclose(a[1], a[2])  # heads differ
    assert not torch.allclose(a[1:], mixing_matrix(cfg_(mixit_seed=1), 0)[1:])  # seeds differ


def test_matrix_survives_save_load_and_is_not_stored():
    model = build_model(cfg_(), seed=0)
    assert not any("mix" in k or k.endswith(".A") for k in model.state_dict())
    x = torch.randint(0, 50, (2, T))
    with tempfile.TemporaryDirectory() as d:
        save_native(model, d, {"step": 3})
        loaded, meta = load_native(d)
    for l0, l1 in zip(model.layers, loaded.layers):
        assert torch.equal(l0.self_attn.matrix(T, torch.device("cpu")), l1.self_attn.matrix(T, torch.device("cpu")))
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert meta["step"] == 3


def test_model_output_equals_dense_reference():
    """The mixing sublayer output is concat_h(A_h V_h) W_o with A from the formulas."""
    cfg = cfg_(mixit_width_base=None)
    model = build_model(cfg, seed=0).eval()
    attn = model.layers[1].self_attn
    x = torch.randn(2, 20, cfg.hidden_size)
    v = (x.double() @ attn.v_proj.weight.double().T).view(2, 20, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    mixed = reference_matrix(cfg, 1, 20) @ v
    want = mixed.transpose(1, 2).reshape(2, 20, -1) @ attn.o_proj.weight.double().T
    with torch.no_grad():
        got = attn(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_companions_follow_config():
    cfg = cfg_()
    block = build_model(cfg, seed=0).layers[0]
    assert block.skip_scale == 0.5 and math.isclose(block.branch_scale, math.sqrt(0.75))
    a = 1 - 1 / math.sqrt(cfg.hidden_size)
    assert math.isclose(block.mlp.leaky_slope, a) and math.isclose(block.mlp.leaky_gain, math.sqrt(2 / (1 + a * a)))
    assert math.isclose(block.mlp.down_proj.out_scale, math.sqrt(512 / cfg.intermediate_size))
    plain = build_model(cfg_(mixit_residual_scale=None, mixit_leaky_c=None, mixit_width_base=None), seed=0).layers[0]
    assert plain.skip_scale == plain.branch_scale == 1.0 and plain.mlp.leaky_slope is None
    deep = build_model(cfg_(mixit_depth_alpha=0.5, mixit_depth_base_layers=1), seed=0).layers[0]
    assert deep.skip_scale == 1.0 and math.isclose(deep.branch_scale, (1 / cfg.num_layers) ** 0.5)


def test_philox_matches_known_words():
    # Philox-4x32-10 known-answer vector (Random123 kat_vectors: ctr 0, key 0).
    words = rng.philox(0, torch.tensor([0]))
    assert [int(w[0]) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


TRITON_CHECK = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
import triton, triton.language as tl
from model import rng
@triton.jit
def k(out_n, out_u, key, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_n + offs, tl.randn(key, offs))
    tl.store(out_u + offs, tl.rand(key, offs))
@triton.jit
def k4(out, key, N: tl.constexpr):
    offs = tl.arange(0, N)
    n1, n2, n3, n4 = tl.randn4x(key, offs)
    tl.store(out + offs, n1)
    tl.store(out + N + offs, n2)
    tl.store(out + 2 * N + offs, n3)
    tl.store(out + 3 * N + offs, n4)
for key in (0, rng.mixit_key(7, 3, 5), rng.mixit_key(2**32 - 1, 100, 31)):
    n, u, n4 = torch.empty(256), torch.empty(256), torch.empty(4, 256)
    k[(1,)](n, u, key, 256)
    k4[(1,)](n4, key, 256)
    w0 = rng.philox(key, torch.arange(256))[0]
    assert torch.equal(u, rng._to_uniform(w0)), "uniform words differ"
    assert (n - rng.randn(key, torch.arange(256))).abs().max() < 1e-5, "normals differ"
    assert (n4 - torch.stack(rng.randn4x(key, torch.arange(256)))).abs().max() < 1e-5, "randn4x normals differ"
print("ok")
"""


def test_rng_matches_triton_randn_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_philox4x_matrix_draws_four_columns_per_counter():
    """mixit_rng philox4x: z[i, j] is lane j % 4 of randn4x at counter i * ceil(T/4) + j // 4, for any T;
    philox's z[i, j] is randn at i * T + j. Each is N(0, 1), and they are different matrices."""
    key, T = rng.mixit_key(3, 1, 2), 22
    rows, cols = torch.arange(T), torch.arange(T)
    z4 = rng.matrix_normals(key, rows, cols, T, "philox4x")
    for i, j in [(0, 0), (0, 3), (5, 4), (21, 21), (7, 13)]:
        want = rng.randn4x(key, torch.tensor([i * 6 + j // 4]))[j % 4][0]
        assert z4[i, j] == want
    z1 = rng.matrix_normals(key, rows, cols, T, "philox")
    assert torch.equal(z1, rng.randn(key, rows[:, None] * T + cols[None, :]))
    assert not torch.equal(z1, z4)
    big = rng.matrix_normals(key, torch.arange(256), torch.arange(256), 256, "philox4x").double()
    assert abs(big.mean()) < 0.02 and abs(big.std() - 1) < 0.02
    with pytest.raises(ValueError, match="philox or philox4x"):
        rng.matrix_normals(key, rows, cols, T, "mt19937")


def test_mixit_rng_is_part_of_the_model():
    with pytest.raises(ConfigError, match="mixit_rng"):
        preset("tiny", variant="mixit", mixit_rng="mt19937")
    a = preset("tiny", variant="mixit", vocab_size=50, max_seq_len=16)
    b = a.replace(mixit_rng="philox4x")
    assert not torch.equal(mixing_matrix(a, 1), mixing_matrix(b, 1))
    assert ModelConfig.from_dict({k: v for k, v in a.to_dict().items() if k != "mixit_rng"}).mixit_rng == "philox"
    with pytest.raises(ValueError, match="mixit_rng: config has 'philox4x', checkpoint has 'philox'"):
        check_compatible(b, a, "ckpt")
