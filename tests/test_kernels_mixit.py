"""MixiT mixing: the dense reference, the blocked PyTorch path and the Triton kernel agree
(forward and A^T backward), and `mixit_impl` dispatch follows the documented rule (the streamed path's
kernels: tests/test_kernels_mixit_streamed.py)."""

import os
import subprocess
import sys

import pytest
import torch
from fixtures import OpDtypes

from model import preset
from model.kernels import select
from model.kernels.mixit_blocked import MixitParams, compute_drift, cumsum_rows, mixit_blocked, raw_slab
from model.kernels.select import MIXIT_DENSE_MAX_T, mixit_backend, mixit_dense_bytes, mixit_streamed_bytes
from model.layers import MixingAttention
from model.mixit import mixing_matrix, raw_block
from model.transformer import build_model
from pretrain.memory import mixit_cache_bytes, mixit_paths

T = 40
CASES = [
    {},
    {"mixit_beta": 0.7, "mixit_seed": 9},
    {"mixit_depth_alpha": 1.0},
    {"causal": False},
    {"num_kv_heads": 2},
    {"mixit_rng": "philox4x"},
]
CASE_IDS = ["default", "beta_seed", "depth_alpha", "bidirectional", "gqa", "philox4x"]


def cfg_(**kw):
    return preset("tiny", **{**dict(variant="mixit", vocab_size=50, max_seq_len=T), **kw})


def dense(cfg, layer, n):
    return mixing_matrix(cfg, layer, cfg.max_seq_len if cfg.causal else n).double()[:, :n, :n]


@pytest.mark.parametrize("generator", ["philox", "philox4x"])
def test_slab_rng_equals_reference_blocks(generator):
    """The per-head-key slab draws exactly mixit.raw_block's numbers."""
    cfg = cfg_(mixit_rng=generator)
    p = MixitParams(cfg, 2)
    rows = torch.arange(5, 13)
    slab = raw_slab(p, rows, 17, p.key_tensor("cpu"), p.sigma_tensor("cpu"))
    for h in range(1, cfg.num_heads):
        ref = raw_block(cfg, 2, h, rows, torch.arange(17), p.sigmas[h - 1])
        assert torch.equal(slab[h - 1], ref)


@pytest.mark.parametrize("kw", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n, row_start", [(T, 0), (23, 0), (23, 7)])
def test_blocked_equals_dense_forward_and_backward(kw, n, row_start):
    """With GQA (the gqa case: 2 heads a V head) V holds the shared heads and the reference repeats them."""
    cfg = cfg_(**kw)
    p = MixitParams(cfg, 1)
    drift = compute_drift(p, cfg.max_seq_len if cfg.causal else n, "cpu", 16)
    torch.manual_seed(0)
    groups = cfg.num_heads // cfg.num_kv_heads
    v = torch.randn(2, cfg.num_kv_heads, n, cfg.head_dim, dtype=torch.float64, requires_grad=True)
    a = dense(cfg, 1, n)[:, row_start:]
    out, ref = mixit_blocked(v, p, drift, row_start, 16, groups), a @ v.repeat_interleave(groups, dim=1)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    g = torch.randn_like(ref)
    (got,) = torch.autograd.grad(out, v, g)
    (want,) = torch.autograd.grad(ref, v, g)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("shape", [(2, 3, 37, 8), (1, 1, 1, 4), (1, 5, 200, 1)])
def test_cumsum_rows_equals_torch_cumsum(shape):
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(cumsum_rows(x), x.cumsum(2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cumsum_rows(x, reverse=True), x.flip(2).cumsum(2).flip(2), rtol=1e-12, atol=1e-12)
    assert cumsum_rows(x).is_contiguous()


def test_drift_is_cached_row_means_and_block_size_free():
    cfg = cfg_()
    p = MixitParams(cfg, 3)
    d16, d7 = compute_drift(p, T, "cpu", 16), compute_drift(p, T, "cpu", 7)
    torch.testing.assert_close(d16, d7, rtol=0, atol=1e-7)
    idx = torch.arange(T)
    for h in range(1, cfg.num_heads):
        m = raw_block(cfg, 3, h, idx, idx, p.sigmas[h - 1]).tril()
        torch.testing.assert_close(d16[h - 1], m.sum(1) / (idx + 1), rtol=0, atol=1e-7)


def test_blocked_gradcheck():
    """Finite differences of the blocked forward against its analytic A^T backward (float64)."""
    for kw in ({}, {"causal": False}, {"mixit_depth_alpha": 1.0}):
        cfg = cfg_(max_seq_len=12, hidden_size=16, intermediate_size=32, **kw)
        p = MixitParams(cfg, 0)
        drift = compute_drift(p, 12 if cfg.causal else 9, "cpu", 5).double()
        v = torch.randn(1, cfg.num_heads, 9, cfg.head_dim, dtype=torch.float64, requires_grad=True)
        for row_start in (0, 4):
            assert torch.autograd.gradcheck(
                lambda x: mixit_blocked(x, p, drift, row_start, 5), (v,), eps=1e-6, atol=1e-6, fast_mode=True
            )


@pytest.mark.parametrize("kw", [{}, {"causal": False}], ids=["causal", "bidirectional"])
def test_model_blocked_equals_dense_end_to_end(kw):
    """The whole model, loss and every parameter gradient, with the two implementations."""
    x = torch.randint(0, 50, (2, 30))
    grads, losses = [], []
    for impl in ("dense", "blocked"):
        model = build_model(cfg_(mixit_impl=impl, mixit_block_size=8, **kw), seed=0)
        loss = model(x[:, :-1], labels=x[:, 1:])
        loss.backward()
        losses.append(loss.detach())
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["dense", "blocked"])
def test_cached_decoding_equals_full_forward(impl):
    model = build_model(cfg_(mixit_impl=impl, mixit_block_size=8), seed=0).eval()
    x = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        parts = [model(x[:, :13], cache=cache)] + [model(x[:, i : i + 1], cache=cache) for i in range(13, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_auto_dispatch_rule():
    cpu = torch.device("cpu")
    assert mixit_backend("auto", MIXIT_DENSE_MAX_T, cpu)[0] == "dense"
    assert mixit_backend("auto", MIXIT_DENSE_MAX_T + 1, cpu)[0] == "blocked"
    assert mixit_backend("blocked", 16, cpu)[0] == "blocked"
    assert mixit_backend("dense", 10**4, cpu)[0] == "dense"
    assert mixit_backend("triton", 16, cpu)[0] == "triton"  # explicit choice is honoured
    assert mixit_backend("streamed", 16, cpu)[0] == "streamed"


# What `auto` picks on CUDA for the presets' causal bf16 models (stored tiles: 2.0, 2.6, 4.0 GiB at T 2048;
# 31.2, 40.6, 62.5 GiB at T 8192), against half of an H100's 80 GB and of an H200's 141 GB
H100, H200 = 80 * 10**9, 141 * 10**9
CUDA_RULE = {
    ("1b", 2048): ("streamed", "streamed"),
    ("1b", 8192): ("streamed", "streamed"),
    ("3b", 2048): ("streamed", "streamed"),
    ("3b", 8192): ("triton", "streamed"),
    ("8b", 2048): ("streamed", "streamed"),
    ("8b", 8192): ("triton", "streamed"),
}


def _auto_on_cuda(name: str, t: int, memory: int, nbytes: int = 2, causal: bool = True) -> str:
    c = preset(name, variant="mixit")
    dense = mixit_dense_bytes(c.num_heads, c.num_layers, t, nbytes)
    tiles = mixit_streamed_bytes(c.num_heads, c.num_layers, t, nbytes, causal)
    return mixit_backend("auto", t, torch.device("cuda"), dense, memory, streamed_bytes=tiles, causal=causal)[0]


@pytest.mark.parametrize("name, t", list(CUDA_RULE), ids=[f"{n}_T{t}" for n, t in CUDA_RULE])
def test_cuda_rule_streams_the_tiles_where_they_fit(name, t, monkeypatch):
    """Causal, on CUDA with Triton: the stored tiles while all layers' fit MIXIT_STREAMED_MEMORY_FRACTION of the
    device, the regenerating kernel above; never dense, whose matrices are twice the tiles' bytes."""
    monkeypatch.setattr(select, "triton_available", lambda: True)
    assert (_auto_on_cuda(name, t, H100), _auto_on_cuda(name, t, H200)) == CUDA_RULE[(name, t)]


def test_cuda_rule_at_its_boundaries_bidirectional_and_without_triton(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(select, "triton_available", lambda: True)
    c = preset("1b", variant="mixit")
    assert mixit_streamed_bytes(c.num_heads, c.num_layers, 2048, 2, True) == 16 * 31 * (32 * 33 // 2) * 64 * 64 * 2
    assert mixit_dense_bytes(c.num_heads, c.num_layers, 2048, 2) == 4 * 2**30  # 16 layers x 32 heads x 2048^2 x bf16
    assert _auto_on_cuda("1b", 2048, H100, nbytes=4) == "streamed"  # float32: 4 GiB of tiles
    assert _auto_on_cuda("1b", 2048, 3 * 2**30) == "triton"  # a 3 GiB card: 2 GiB of tiles > 1.5
    budget = int(select.MIXIT_STREAMED_MEMORY_FRACTION * H100)
    assert mixit_backend("auto", 1, cuda, None, H100, streamed_bytes=budget)[0] == "streamed"
    assert mixit_backend("auto", 1, cuda, None, H100, streamed_bytes=budget + 1)[0] == "triton"
    # padding to whole tiles can make them outweigh the matrix at a short T: dense where only it fits
    assert mixit_backend("auto", 1, cuda, budget, H100, streamed_bytes=budget + 1)[0] == "dense"
    # bidirectional: the tiles are the whole square, so dense keeps the sizes where it fits, the tiles
    # take the sizes where only they fit
    assert _auto_on_cuda("1b", 2048, H100, causal=False) == "dense"
    assert _auto_on_cuda("1b", 8192, H200, causal=False) == "dense"  # 64 GiB <= 65.7
    assert _auto_on_cuda("1b", 8192, H100, causal=False) == "triton"  # 62 GiB of tiles > 37.3
    assert mixit_backend("auto", 1, cuda, budget + 1, H100, streamed_bytes=budget, causal=False)[0] == "streamed"
    assert mixit_backend("dense", 8192, cuda, 10**12, H100)[0] == "dense"  # explicit choices are honoured
    assert mixit_backend("streamed", 8192, cuda, None, H100, streamed_bytes=10**12)[0] == "streamed"
    monkeypatch.setattr(select, "triton_available", lambda: False)  # CUDA without Triton: the old rule
    assert _auto_on_cuda("1b", 2048, H100) == "dense"
    assert _auto_on_cuda("1b", 8192, H200) == "dense"
    assert _auto_on_cuda("1b", 8192, H100) == "blocked"


def test_cuda_rule_streams_the_leading_layers_whose_tiles_fit(monkeypatch):
    """Where the tiles of every layer do not fit, those of the leading layers that do stream, the others
    regenerate: preset 1b at T 16,384 (124.5 GiB of bf16 tiles, 7.8 GiB a layer) streams 8 of its 16 layers
    on a 141 GB card and 4 on an 80 GB one; the memory estimate counts those tiles."""
    monkeypatch.setattr(select, "triton_available", lambda: True)
    c = preset("1b", variant="mixit", max_seq_len=16384)
    tiles = mixit_streamed_bytes(c.num_heads, c.num_layers, 16384, 2, True)
    assert tiles / 2**30 == pytest.approx(124.5, abs=0.05)
    dense = mixit_dense_bytes(c.num_heads, c.num_layers, 16384, 2)
    for memory, leading in ((H200, 8), (H100, 4)):
        paths = [
            mixit_backend("auto", 16384, torch.device("cuda"), dense, memory, tiles, True, i, c.num_layers)
            for i in range(c.num_layers)
        ]
        assert [impl for impl, _ in paths] == ["streamed"] * leading + ["triton"] * (16 - leading), memory
        assert f"the first {leading} of 16 layers" in paths[0][1] and f"layers from {leading}" in paths[-1][1]
        assert len({reason for _, reason in paths}) == 2  # logged once per path, not once per layer
        assert mixit_paths(c, 2, "cuda", memory) == [impl for impl, _ in paths]
        assert mixit_cache_bytes(c, 2, [impl for impl, _ in paths]) == leading * tiles / 16
        assert mixit_cache_bytes(c, 2, [impl for impl, _ in paths]) <= select.MIXIT_STREAMED_MEMORY_FRACTION * memory
    with torch.device("meta"):
        layers = [MixingAttention(c, i) for i in range(c.num_layers)]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": H200}))
    got = [layer.impl(torch.device("cuda"), torch.bfloat16) for layer in layers]
    assert got == ["streamed"] * 8 + ["triton"] * 8
    # where every layer's tiles fit, all stream, as before
    assert _auto_on_cuda("1b", 8192, H100) == "streamed"


@pytest.mark.parametrize("impl", ["dense", "blocked"])
@pytest.mark.parametrize("past", [0, 9])
def test_gqa_reads_vs_shared_heads_without_repeating_them(past, impl):
    """The dense and blocked paths with 2 heads a V head: each head's output is A_h @ V_(h // 2) (the
    repeated-head reference, float64) in the forward and in V's gradient, and V is never repeated to every
    head (as repeat_interleave does, by expand + clone)."""
    cfg = cfg_(num_heads=4, num_kv_heads=2, mixit_impl=impl)
    atol = 1e-12 if impl == "dense" else 2e-6  # blocked: drift is computed in float32
    layer = MixingAttention(cfg, 1).double()
    torch.manual_seed(0)
    t, b = 12, 2
    v = torch.randn(b, cfg.num_kv_heads, past + t, cfg.head_dim, dtype=torch.float64, requires_grad=True)
    a = layer.matrix(past + t, torch.device("cpu"), torch.float64)[:, past:, :]
    ref = a @ v.repeat_interleave(2, dim=1)  # (b, H, t, dh)
    layer.v_proj = torch.nn.Identity()  # the mixing alone: x is V's heads, flattened
    layer.o_proj = torch.nn.Identity()
    x = v.transpose(1, 2).reshape(b, past + t, cfg.num_kv_heads * cfg.head_dim)

    class Past:  # a KV cache that holds V's first `past` positions
        def past_length(self, i):
            return past

        def update(self, i, k, new):
            return None, torch.cat([v[:, :, :past], new], 2)

    with OpDtypes() as ops:
        out = layer(x[:, past:], cache=Past() if past else None)
    repeated = b * cfg.num_heads * (past + t) * cfg.head_dim  # V at every head (the blocked path expands smaller)
    assert not [op for op, _, n in ops.seen if ("expand" in op or "repeat" in op) and n == repeated], ops.seen
    got = out.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    torch.testing.assert_close(got, ref, rtol=0, atol=atol)
    g = torch.randn_like(ref)
    (dv_ref,) = torch.autograd.grad(ref, v, g)
    (dv,) = torch.autograd.grad(got, v, g)
    torch.testing.assert_close(dv, dv_ref, rtol=0, atol=atol)


def test_blocked_never_builds_the_dense_matrix(monkeypatch):
    import model.mixit as mixit_mod

    monkeypatch.setattr(mixit_mod, "mixing_matrix", lambda *a, **k: pytest.fail("dense A was built"))
    model = build_model(cfg_(mixit_impl="blocked"), seed=0)
    x = torch.randint(0, 50, (1, 16))
    model(x, labels=x).backward()
    assert all(k[0] == "drift" for layer in model.layers for k in layer.self_attn._cache)


# ---- Triton: on CPU under the interpreter (a subprocess: the env var must precede the import) ----
TRITON_CHECK = r"""
import os, sys, torch
assert os.environ.get("TRITON_INTERPRET") == "1"
from model import preset
from model.mixit import mixing_matrix
from model.kernels import mixit_triton as mt
from model.kernels.mixit_blocked import MixitParams, compute_drift
torch.manual_seed(0)
cases = [({}, 24, 0), ({}, 17, 5), ({"mixit_beta": 0.7, "mixit_depth_alpha": 1.0}, 24, 0), ({"causal": False}, 17, 0)]
four = {"mixit_rng": "philox4x"}  # four columns per Philox call; T 22 is not a multiple of 4
cases += [(four, 17, 5), ({**four, "causal": False, "max_seq_len": 22}, 22, 0)]
cases += [({"num_kv_heads": 2}, 24, 0), ({"num_kv_heads": 2, "causal": False}, 17, 0), ({"num_kv_heads": 1}, 17, 5)]
# Run-time loop bounds where this interpreter takes them (newer Triton), and the constant-bound
# sweep that an older interpreter under numpy >= 2.4 needs, in both cases against the reference.
sweeps = [True] if mt.sweep_all_tiles() else [False, True]
for sweep in sweeps:
    mt.sweep_all_tiles = lambda: sweep
    for kw, n, rs in cases:
        cfg = preset("tiny", **{"variant": "mixit", "vocab_size": 50, "max_seq_len": 24, **kw})
        p = MixitParams(cfg, 1)
        full = cfg.max_seq_len if cfg.causal else n
        a = mixing_matrix(cfg, 1, full).double()[:, rs:n, :n]
        drift = compute_drift(p, full, "cpu", 16)
        groups = cfg.num_heads // cfg.num_kv_heads  # GQA: V holds the shared heads, the reference repeats them
        v = torch.randn(2, cfg.num_kv_heads, n, cfg.head_dim, requires_grad=True)
        out = mt.mixit_triton(v, p, drift, rs, 16, groups)
        ref = a @ v.double().repeat_interleave(groups, dim=1)
        err = (out.double() - ref).abs().max().item()
        assert err < 2e-6, (sweep, kw, n, rs, "forward", err)
        if rs == 0:
            g = torch.randn_like(ref)
            got, = torch.autograd.grad(out, v, g.float())
            want, = torch.autograd.grad(ref, v, g)
            err = (got.double() - want).abs().max().item()
            assert err < 2e-6, (sweep, kw, n, "backward", err)
print("ok", sweeps)
"""


def test_triton_kernel_equals_dense_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# ---- GPU parity (skipped where no CUDA device exists) -------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kw", [{}, {"causal": False}, {"mixit_depth_alpha": 1.0}, {"num_kv_heads": 2}])
def test_triton_equals_dense_on_gpu(kw):
    pytest.importorskip("triton")
    from model.kernels.mixit_triton import mixit_triton

    cfg = cfg_(max_seq_len=512, hidden_size=256, num_heads=4, **kw)
    p = MixitParams(cfg, 1)
    n = 500
    full = cfg.max_seq_len if cfg.causal else n
    a = mixing_matrix(cfg, 1, full, "cuda")[:, :n, :n].double()
    drift = compute_drift(p, full, "cuda", 128)
    groups = cfg.num_heads // cfg.num_kv_heads
    v = torch.randn(2, cfg.num_kv_heads, n, cfg.head_dim, device="cuda", requires_grad=True)
    out = mixit_triton(v, p, drift, 0, 64, groups)
    ref = a @ v.double().repeat_interleave(groups, dim=1)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-3)  # tf32 dots
    g = torch.randn_like(ref)
    (got,) = torch.autograd.grad(out, v, g.float())
    (want,) = torch.autograd.grad(ref, v, g)  # float32: the gradient of v, through its cast to float64
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=5e-3)


@pytest.mark.gpu
@gpu
def test_model_triton_equals_dense_on_gpu():
    x = torch.randint(0, 50, (2, 40), device="cuda")
    losses = []
    for impl in ("dense", "triton"):
        model = build_model(cfg_(mixit_impl=impl), seed=0, device="cuda")
        losses.append(model(x, labels=x).item())
    assert abs(losses[0] - losses[1]) < 1e-3
