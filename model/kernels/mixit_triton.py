"""MixiT mixing as a Triton kernel that regenerates M in registers (no T x T tensor anywhere).

Each program owns a (batch, head, row block) tile and walks key blocks j <= i only. M_h[i, j] is
sigma_h * tl.randn(key_h, i*T + j) (`mixit_rng: philox`; with philox4x, tl.randn4x gives four
columns per call): model/rng.py's matrix_normals, so the dense reference can be compared with it.
Centering and identity are fused into the epilogue; cumsum(V), drift_h and the sink head 0 come
from PyTorch (the algebra: docs/PERFORMANCE.md). Backward: dV = A^T dO, the same walk over row
blocks i >= j with M^T. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from .mixit_blocked import MixitParams, SinkAndRandomHeads, cumsum_rows

# kernel argument -> Triton signature type, for compiling the kernels ahead of time without a GPU
# (tests/test_kernels_hopper.py, benchmarks/mixit_sass.py); a new kernel argument is added here
ARG_TYPES = {
    **dict.fromkeys(["V", "CS", "O", "SIG", "DRIFT", "G", "DV"], "*fp32"),
    "KEYS": "*i64",
    "beta": "fp32",
    **dict.fromkeys(["n", "row_start", "T", "Hr", "GROUPS"], "i32"),
    **dict.fromkeys(["svb", "svh", "svt", "sob", "soh", "sot", "sdh", "sgb", "sgh", "sgt"], "i32"),
}


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401  # deferred: optional, probed
        import triton.language  # noqa: F401  # deferred: optional, probed
    except Exception:  # ImportError, or a broken install
        return False
    return True


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton  # deferred: heavy
    import triton.language as tl  # deferred: heavy

    @triton.jit
    def fwd(
        V,
        CS,
        O,
        KEYS,
        SIG,
        DRIFT,
        n,
        row_start,
        T,
        beta,
        svb,
        svh,
        svt,
        sob,
        soh,
        sot,
        sdh,
        Hr,
        GROUPS,
        DH: tl.constexpr,
        IDENT: tl.constexpr,
        CAUSAL: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BD: tl.constexpr,
        SWEEP_N: tl.constexpr,
        RNG4X: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = pid_bh // Hr
        h = pid_bh % Hr
        rows = row_start + pid_m * BM + tl.arange(0, BM)
        row_ok = rows < n
        d = tl.arange(0, BD)
        d_ok = d < DH
        key = tl.load(KEYS + h)
        sigma = tl.load(SIG + h)
        kvh = (h + 1) // GROUPS  # random head h + 1 reads V's head (h + 1) // GROUPS (GQA)
        v_base = V + b * svb + kvh * svh
        acc = tl.zeros((BM, BD), dtype=tl.float32)
        if CAUSAL:
            hi = tl.minimum(n, row_start + (pid_m + 1) * BM)
        else:
            hi = n
        # SWEEP_N: loop over every key tile to a constant bound (the mask zeroes those past hi),
        # written inline since the interpreter turns every assigned value into a tensor.
        for start in range(0, SWEEP_N if SWEEP_N else hi, BN):
            cols = start + tl.arange(0, BN)
            ok = row_ok[:, None] & (cols[None, :] < n)
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None])
            if RNG4X:  # mixit_rng philox4x: four consecutive columns from one Philox call (model/rng.py)
                quads = start // 4 + tl.arange(0, BN // 4)
                n1, n2, n3, n4 = tl.randn4x(key, rows[:, None] * ((T + 3) // 4) + quads[None, :])
                z = tl.reshape(tl.join(tl.join(n1, n3), tl.join(n2, n4)), (BM, BN))
            else:
                z = tl.randn(key, rows[:, None] * T + cols[None, :])
            m = tl.where(ok, z * sigma, 0.0)
            vb = tl.load(v_base + cols[:, None] * svt + d[None, :], mask=(cols[:, None] < n) & d_ok[None, :], other=0.0)
            acc += tl.dot(m, vb.to(tl.float32))
        tile = rows[:, None] * svt + d[None, :]
        tmask = row_ok[:, None] & d_ok[None, :]
        cs = tl.load(CS + b * svb + kvh * svh + tile, mask=tmask, other=0.0)
        drift = tl.load(DRIFT + h * sdh + rows, mask=row_ok, other=0.0)
        out = beta * (acc - drift[:, None] * cs)
        if IDENT:
            out += tl.load(v_base + tile, mask=tmask, other=0.0).to(tl.float32)
        o_ptr = O + b * sob + h * soh + (rows[:, None] - row_start) * sot + d[None, :]
        tl.store(o_ptr, out, mask=tmask)

    @triton.jit
    def bwd(
        G,
        DV,
        KEYS,
        SIG,
        n,
        T,
        beta,
        sgb,
        sgh,
        sgt,
        Hr,
        DH: tl.constexpr,
        CAUSAL: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BD: tl.constexpr,
        SWEEP_N: tl.constexpr,
        RNG4X: tl.constexpr,
    ):
        # dV_j (matrix part only) = beta * sum_{i >= j} M[i, j] G_i ; row_start == 0
        pid_bh = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = pid_bh // Hr
        h = pid_bh % Hr
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < n
        d = tl.arange(0, BD)
        d_ok = d < DH
        key = tl.load(KEYS + h)
        sigma = tl.load(SIG + h)
        g_base = G + b * sgb + h * sgh
        acc = tl.zeros((BN, BD), dtype=tl.float32)
        if CAUSAL:
            lo = (pid_n * BN // BM) * BM
        else:
            lo = 0
        # SWEEP_N: every row tile to a constant bound (the mask zeroes those before lo), inline.
        for start in range(0 if SWEEP_N else lo, SWEEP_N if SWEEP_N else n, BM):
            rows = start + tl.arange(0, BM)
            ok = (rows[:, None] < n) & col_ok[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None])
            if RNG4X:
                quads = pid_n * (BN // 4) + tl.arange(0, BN // 4)
                n1, n2, n3, n4 = tl.randn4x(key, rows[:, None] * ((T + 3) // 4) + quads[None, :])
                z = tl.reshape(tl.join(tl.join(n1, n3), tl.join(n2, n4)), (BM, BN))
            else:
                z = tl.randn(key, rows[:, None] * T + cols[None, :])
            m = tl.where(ok, z * sigma, 0.0)
            gb = tl.load(g_base + rows[:, None] * sgt + d[None, :], mask=(rows[:, None] < n) & d_ok[None, :], other=0.0)
            acc += tl.dot(tl.trans(m), gb.to(tl.float32))
        ptr = DV + b * sgb + h * sgh + cols[:, None] * sgt + d[None, :]
        tl.store(ptr, beta * acc, mask=col_ok[:, None] & d_ok[None, :])

    @triton.jit
    def loop_probe(OUT, n):
        acc = 0
        for _ in range(0, n):
            acc += 1
        tl.store(OUT, acc)

    return fwd, bwd, loop_probe


@functools.lru_cache(maxsize=1)
def sweep_all_tiles() -> bool:
    """True only under a Triton interpreter that cannot loop to a run-time bound.

    Triton 3.6's interpreter reads a scalar loop bound with int() of a one-element numpy
    array, which numpy >= 2.4 refuses (triton-lang/triton#9171). There both kernels loop to
    the constant n and the mask zeroes the tiles the run-time bounds skip (the same sums);
    compiled kernels and newer interpreters keep the run-time bounds.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    probe = _kernels()[2]
    out = torch.zeros(1, dtype=torch.int32)
    try:
        probe[(1,)](out, 3)
    except Exception:  # triton.runtime.errors.InterpreterError wrapping numpy's TypeError
        return True
    return int(out[0]) != 3


# Largest row/key tile the kernel uses, and the warps at that size. Compiled for sm_90 (H100:
# 232,448 B shared memory per block, 255 registers per thread), a 128 x 128 tile needs 262,144 B
# at head dim 128 and spills registers at every head dim; 64 x 64 with 8 warps fits without spills
# at head dims 16..128 (tests/test_kernels_hopper.py compiles every tile the presets and tests use).
MAX_TILE = 64


class Tiles(NamedTuple):
    """Launch shape of both kernels: row tile BM, key tile BN, padded head dim BD, warps, stages."""

    BM: int
    BN: int
    BD: int
    num_warps: int
    num_stages: int


def launch_meta(t: Tiles, n: int, generator: str) -> dict[str, int]:
    """The compile-time and launch keywords both kernels take for tile `t` over `n` rows, drawing
    M with `generator` (the model's mixit_rng)."""
    return dict(
        BM=t.BM,
        BN=t.BN,
        BD=t.BD,
        SWEEP_N=n if sweep_all_tiles() else 0,
        RNG4X=generator == "philox4x",
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )


def tiles(dh: int, block: int) -> Tiles:
    """The tile both kernels launch with for head dim `dh` and the config's mixit_block_size.

    The block is rounded up to a power of two and held in [16, MAX_TILE]; the result does not
    depend on it beyond the float summation order over key tiles.
    """
    bd = max(16, 1 << (dh - 1).bit_length())
    b = max(16, min(1 << (max(block, 1) - 1).bit_length(), MAX_TILE))
    return Tiles(b, b, bd, 8 if b >= 64 else 4, 3)


def triton_forward(
    p: MixitParams, v: torch.Tensor, drift: torch.Tensor, row_start: int, block: int, groups: int = 1
) -> torch.Tensor:
    """Heads 1..H-1: v (b, H / groups, n, dh), every head's values, head h reading V's head h // groups ->
    (b, H-1, n - row_start, dh), computed in float32."""
    import triton  # deferred: heavy

    v = v.float().contiguous()
    fwd = _kernels()[0]
    b, _, n, dh = v.shape
    Hr = len(p.keys)
    cs = cumsum_rows(v) if p.causal else v.sum(2, keepdim=True).expand_as(v).contiguous()
    out = torch.empty(b, Hr, n - row_start, dh, dtype=torch.float32, device=v.device)
    keys = torch.tensor(p.keys, dtype=torch.int64, device=v.device)
    sig = torch.tensor(p.sigmas, dtype=torch.float32, device=v.device)
    drift = drift.contiguous()
    t = tiles(dh, block)
    grid = (b * Hr, triton.cdiv(n - row_start, t.BM))
    strides = (*v.stride()[:3], *out.stride()[:3], drift.stride(0))
    meta = dict(DH=dh, IDENT=p.identity, CAUSAL=p.causal, **launch_meta(t, n, p.generator))
    fwd[grid](v, cs, out, keys, sig, drift, n, row_start, p.T, p.beta, *strides, Hr, groups, **meta)
    return out


def triton_backward(
    p: MixitParams, g: torch.Tensor, drift: torch.Tensor, row_start: int, n: int, block: int
) -> torch.Tensor:
    """Heads 1..H-1, row_start == 0: g (b, H-1, n, dh) -> dV = A^T g, computed in float32."""
    import triton  # deferred: heavy

    if row_start:
        raise NotImplementedError("MixiT triton backward with a KV-cache offset (decoding is inference-only)")
    g = g.float().contiguous()
    bwd = _kernels()[1]
    b, Hr, _, dh = g.shape
    dv = torch.empty_like(g)
    keys = torch.tensor(p.keys, dtype=torch.int64, device=g.device)
    sig = torch.tensor(p.sigmas, dtype=torch.float32, device=g.device)
    t = tiles(dh, block)
    grid = (b * Hr, triton.cdiv(n, t.BN))
    meta = dict(DH=dh, CAUSAL=p.causal, **launch_meta(t, n, p.generator))
    bwd[grid](g, dv, keys, sig, n, p.T, p.beta, *g.stride()[:3], Hr, **meta)
    dg = drift[None, :, :n, None] * g
    if p.causal:
        dv -= p.beta * cumsum_rows(dg, reverse=True)
    else:
        dv -= p.beta * dg.sum(2, keepdim=True)
    if p.identity:
        dv += g
    return dv


def mixit_triton(
    v: torch.Tensor, p: MixitParams, drift: torch.Tensor, row_start: int = 0, block: int = 64, groups: int = 1
) -> torch.Tensor:
    """A V for rows row_start..n-1 via the fused kernel; same contract as mixit_blocked."""
    return SinkAndRandomHeads.apply(v, p, drift, row_start, block, (triton_forward, triton_backward), groups)
