"""MixiT's streamed path (model/kernels/mixit_streamed.py) on CPU under the Triton interpreter: the stored
tiles are the regenerating kernel's draws bit for bit (beta (M - drift 1^T) of them when causal, beta M
when bidirectional, computed in float32) and assemble into the dense path's A; forward and backward equal
a float64 product with the stored tiles (the streamed path's reference of record); the model gives the
dense path's loss and gradients (the same under selective and full activation checkpointing), decodes
with a cache, and writes its tiles once. Each check runs in a subprocess, since TRITON_INTERPRET must be
set before Triton is imported."""

import os
import subprocess
import sys

import pytest
import torch

from model import preset
from model.kernels.mixit_blocked import MixitParams, compute_drift
from model.kernels.mixit_streamed import TILE, tile_count

PRELUDE = r"""
import copy, os, torch
assert os.environ.get("TRITON_INTERPRET") == "1"
from model import preset
from model.mixit import mixing_matrix, raw_block
from model.kernels import mixit_streamed as ms, mixit_triton as mt
from model.kernels.mixit_blocked import MixitParams, compute_drift
torch.manual_seed(0)

def cfg_(**kw):
    return preset("tiny", **{"variant": "mixit", "vocab_size": 50, "max_seq_len": 100, **kw})

def untile(tiles, T, causal):
    # (H-1, tiles, 64, 64) -> (H-1, T, T): tile k is (r, c), k = r(r+1)/2 + c (causal) or r*nb + c
    nb = -(-T // ms.TILE)
    out = tiles.new_zeros(tiles.shape[0], nb * ms.TILE, nb * ms.TILE)
    pairs = [(r, c) for r in range(nb) for c in range(r + 1 if causal else nb)]
    assert len(pairs) == tiles.shape[1]
    for k, (r, c) in enumerate(pairs):
        out[:, r * ms.TILE : (r + 1) * ms.TILE, c * ms.TILE : (c + 1) * ms.TILE] = tiles[:, k]
    return out, out[:, :T, :T]
"""

# The regenerating kernel's own draw, read back: with V = I, drift 0, beta 1 and no identity term its
# forward returns M's entries (one nonzero product per sum, so exact in float32). The tiles store
# beta (M - drift 1^T) (causal) or beta M (bidirectional) of that draw, in float32's operations, so bit for
# bit too.
TILES_CHECK = r"""
for kw in ({}, {"causal": False}, {"mixit_rng": "philox4x"}, {"mixit_rng": "philox4x", "causal": False},
           {"mixit_beta": 0.7}, {"mixit_beta": 0.5, "causal": False}):
    cfg = cfg_(**kw)
    T, hr = cfg.max_seq_len, cfg.num_heads - 1
    p = MixitParams(cfg, 1)
    drift = compute_drift(p, T, "cpu", 16)
    fold = drift if cfg.causal else None
    padded, m = untile(ms.generate_tiles(p, torch.float32, "cpu", fold), T, cfg.causal)
    probe = copy.copy(p)
    probe.identity, probe.beta = False, 1.0
    eye = torch.eye(T).expand(1, cfg.num_heads, T, T).contiguous()  # every head's V (head 0's unread)
    drawn = mt.triton_forward(probe, eye, torch.zeros(hr, T), 0, 64)[0]
    idx = torch.arange(T)
    seen = idx[:, None] >= idx[None, :] if cfg.causal else torch.ones(T, T, dtype=torch.bool)
    stored = (drawn - drift[:, :, None]) * cfg.mixit_beta * seen if cfg.causal else drawn * cfg.mixit_beta
    assert torch.equal(m, stored), (kw, (m - stored).abs().max())
    assert padded[:, T:].abs().sum() == 0 and padded[:, :, T:].abs().sum() == 0, kw
    for h in range(1, cfg.num_heads):  # model/rng.py's reference (torch's log/cos: within float rounding)
        ref = raw_block(cfg, 1, h, idx, idx, p.sigmas[h - 1]) * seen
        torch.testing.assert_close(drawn[h - 1], ref, rtol=1e-6, atol=1e-8)
    # the tiles hold beta (M - drift 1^T) (causal) or beta M (bidirectional)
    # A assembled from the tiles as mixing_matrix assembles it from its draw: the dense path's matrix, to
    # float32's rounding (the draw's transcendentals above, drift's summation order; 1.2e-7 apart at 1)
    a = (m if cfg.causal else m - cfg.mixit_beta * drift[:, :, None]) + torch.eye(T)
    torch.testing.assert_close(a * seen, mixing_matrix(cfg, 1)[1:], rtol=0, atol=3e-7)
    # bf16 storage: the same entries rounded (within one bf16 unit; the interpreter truncates)
    _, m16 = untile(ms.generate_tiles(p, torch.bfloat16, "cpu", fold), T, cfg.causal)
    assert ((m16.float() - m).abs() <= m.abs() * 2**-7).all(), kw
try:  # causal tiles need the drift they fold in
    ms.generate_tiles(MixitParams(cfg_(), 1), torch.float32, "cpu")
    raise AssertionError("causal tiles were made without a drift")
except ValueError as e:
    assert "fold the drift" in str(e), e
print("ok")
"""

# Forward (any row offset) and backward against float64 A @ V with the dense path's A: causal and
# bidirectional, the depth_alpha path (no identity term), T and n not multiples of 64, one sequence and
# three (one program for all three, and two programs of two with MAX_WIDTH cut), both loop modes; GQA (2 and
# 4 heads reading one V head, causal and bidirectional, with a row offset) against V repeated to every head.
KERNEL_CHECK = r"""
cases = [({}, 100, 0, 3), ({}, 70, 0, 1), ({}, 100, 37, 2), ({"causal": False}, 70, 0, 3),
         ({"causal": False}, 100, 0, 1), ({"mixit_depth_alpha": 1.0, "mixit_beta": 0.7}, 100, 0, 2),
         ({"mixit_rng": "philox4x"}, 90, 0, 3), ({"num_kv_heads": 2}, 64, 0, 2), ({"num_kv_heads": 1}, 100, 0, 1),
         ({"num_kv_heads": 2, "causal": False}, 70, 0, 2), ({"num_kv_heads": 2}, 100, 37, 1)]
# run-time loop bounds where this interpreter takes them (mixit_triton.sweep_all_tiles), with the launcher's
# width and a cut one (head dim 16: two sequences a program); the constant-bound sweep at the launcher's
sweeps = [True] if ms.sweep_all_tiles() else [False, True]
modes = [(sweeps[0], ms.MAX_WIDTH), (sweeps[0], 32)] + [(True, ms.MAX_WIDTH)] * (len(sweeps) - 1)
for sweep, width in modes:
    ms.sweep_all_tiles = lambda: sweep
    ms.MAX_WIDTH = width
    for kw, n, rs, b in cases:
        cfg = cfg_(**kw)
        p = MixitParams(cfg, 1)
        full = cfg.max_seq_len if cfg.causal else n
        drift = compute_drift(p, full, "cpu", 16)
        a = mixing_matrix(cfg, 1, full).double()[:, rs:n, :n]
        fold = drift if cfg.causal else None
        tiles = {d: ms.generate_tiles(p, d, "cpu", fold) for d in (torch.float32, torch.bfloat16)}
        m = {d: untile(t, cfg.max_seq_len, cfg.causal)[1].double()[:, rs:n, :n] for d, t in tiles.items()}
        for dtype in (torch.float32, torch.bfloat16):
            where = f"{sweep} {width} {kw} n={n} row_start={rs} b={b} {dtype}"
            # GQA: V's heads shared by the kernels, against the product with them repeated
            groups = cfg.num_heads // cfg.num_kv_heads
            v = torch.randn(b, cfg.num_kv_heads, n, cfg.head_dim).to(dtype).requires_grad_()
            vx = v.repeat_interleave(groups, 1)
            out = ms.mixit_streamed(v, tiles[dtype], p, drift, rs, groups)
            assert out.dtype == dtype and out.shape == (b, cfg.num_heads, n - rs, cfg.head_dim), where
            if dtype == torch.float32:
                ref = a @ vx.double()
                tol = dict(rtol=0, atol=4e-6)
            else:  # the product with the stored bf16 entries, exact but for the output's rounding
                a16 = a.clone()  # causal tiles hold beta (M - drift 1^T), bidirectional ones beta M
                a16[1:] += m[dtype] - m[torch.float32]
                ref = a16 @ vx.double()
                tol = dict(rtol=2**-7, atol=1e-5)
            torch.testing.assert_close(out.double(), ref, **tol, msg=lambda e: f"{where} forward: {e}")
            if rs == 0:
                g = torch.randn(out.shape).to(dtype)
                (got,) = torch.autograd.grad(out, v, g)
                (want,) = torch.autograd.grad(ref, v, g.double())
                if groups > 1 and dtype == torch.bfloat16:  # a sum over the group's heads, rounded once: the
                    tol = dict(rtol=2**-7, atol=2**-7 * float(want.abs().max()))  # rounding of its larger terms
                torch.testing.assert_close(got.double(), want.double(), **tol, msg=lambda e: f"{where} backward: {e}")
print("ok", sweeps)
"""

MODEL_CHECK = r"""
import model.layers as layers
from model.transformer import build_model
made = []
real = layers.generate_tiles
layers.generate_tiles = lambda *a, **k: made.append(a[0].layer) or real(*a, **k)
x = torch.randint(0, 50, (3, 71))
for kw in ({}, {"causal": False}, {"mixit_depth_alpha": 1.0}, {"num_kv_heads": 2}):
    grads, losses = [], []
    for impl in ("dense", "streamed"):
        model = build_model(cfg_(mixit_impl=impl, **kw), seed=0)
        for _ in range(2):  # the second step reads the cached tiles
            model.zero_grad()
            loss = model(x[:, :-1], labels=x[:, 1:])
            loss.backward()
        losses.append(loss.detach())
        grads.append({k: q.grad for k, q in model.named_parameters() if q.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-5)
    assert made == [0, 1], (kw, made)  # once per layer: the tiles are cached for the model's life
    made.clear()
# the trainer's selective and full checkpointing around the streamed kernels (run again in the backward)
from pretrain.parallelize import apply_activation_checkpointing
runs = []
for mode in ("none", "selective", "full"):
    model = build_model(cfg_(mixit_impl="streamed", num_kv_heads=2), seed=0)
    apply_activation_checkpointing(model, mode)
    loss = model(x[:, :-1], labels=x[:, 1:])
    loss.backward()
    runs.append((loss.detach(), [q.grad for q in model.parameters() if q.grad is not None]))
for loss, grads in runs[1:]:
    assert torch.equal(loss, runs[0][0]) and all(torch.equal(a, b) for a, b in zip(grads, runs[0][1]))
model = build_model(cfg_(mixit_impl="streamed"), seed=0).eval()
with torch.no_grad():
    full = model(x[:, :30])
    cache = model.new_cache()
    parts = [model(x[:, :13], cache=cache)] + [model(x[:, i : i + 1], cache=cache) for i in range(13, 30)]
torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
print("ok")
"""


def _interpret(script: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    run = [sys.executable, "-c", PRELUDE + script]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_tiles_are_the_regenerating_kernels_draw_and_the_dense_matrix():
    _interpret(TILES_CHECK)


def test_streamed_equals_float64_dense_forward_and_backward():
    _interpret(KERNEL_CHECK)


def test_model_streamed_equals_dense_decodes_and_caches_its_tiles():
    _interpret(MODEL_CHECK)


def test_tile_count_and_layout_bytes():
    """Causal keeps the nb (nb + 1) / 2 tiles on and below the diagonal; bidirectional all nb^2."""
    assert tile_count(64, True) == 1 and tile_count(65, True) == 3 and tile_count(8192, True) == 128 * 129 // 2
    assert tile_count(100, False) == 4 and tile_count(8192, False) == 128**2
    assert TILE == 64


# ---- GPU (skipped where no CUDA device exists) --------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kw", [{}, {"causal": False}, {"mixit_depth_alpha": 1.0}])
def test_streamed_equals_dense_on_gpu(kw):
    """bf16 tiles are float32 tiles rounded to nearest (the compiled cast), and the bf16 forward and
    backward stay within bf16's rounding of the float64 product with the dense path's A."""
    pytest.importorskip("triton")
    from model.kernels.mixit_streamed import generate_tiles, mixit_streamed
    from model.mixit import mixing_matrix

    cfg = preset("tiny", variant="mixit", vocab_size=50, max_seq_len=1000, hidden_size=512, num_heads=4, **kw)
    p = MixitParams(cfg, 1)
    n = 900
    full = cfg.max_seq_len if cfg.causal else n
    drift = compute_drift(p, full, "cuda", 128)
    fold = drift if cfg.causal else None
    tiles = generate_tiles(p, torch.bfloat16, "cuda", fold)
    assert torch.equal(tiles, generate_tiles(p, torch.float32, "cuda", fold).bfloat16())
    a = mixing_matrix(cfg, 1, full, "cuda")[:, :n, :n].double()
    v = torch.randn(3, cfg.num_heads, n, cfg.head_dim, device="cuda").bfloat16().requires_grad_()
    out = mixit_streamed(v, tiles, p, drift)
    ref = a @ v.double()
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(ref).bfloat16()
    (got,) = torch.autograd.grad(out, v, g)
    (want,) = torch.autograd.grad(ref, v, g.double())
    torch.testing.assert_close(got.double(), want.double(), rtol=2e-2, atol=2e-2)
