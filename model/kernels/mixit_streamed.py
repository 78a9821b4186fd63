"""MixiT mixing from stored draws: M written once per layer and device as 64 x 64 tiles, then streamed
through the kernels the way FlashAttention streams K and V (docs/PERFORMANCE.md).

The regenerating kernel (mixit_triton.py) makes every tile's normals with Philox for every sequence,
in the forward, the backward and an activation-checkpoint recompute: about 3,400 ns a 64 x 64 tile,
where reading a stored bf16 tile from HBM takes about 225-323 ns. Here `generate_tiles` draws
M_h[i, j] = sigma_h * tl.randn(key_h, i*T + j) for heads 1..H-1 once, with the regenerating kernel's
own expression (the same numbers), into the tiles on and below the diagonal (every tile when
bidirectional). Causal tiles hold A_h - I = beta (M_h - drift_h 1^T) on and below the diagonal,
computed in float32 and rounded once to the storage dtype: the centering and beta are folded into
the stored entries (drift_h[i] depends on row i only, so the same tiles serve every t <= T), and the
forward and backward are plain products with them, without the prefix sums of V and of drift * G
(and their float32 copies) that the regenerating kernel's epilogue needs. **The stored tiles are the
streamed path's reference of record**: in bf16 its A is that rounding of beta (M - drift 1^T) + I,
not the regenerating kernel's float32 product (it agrees with it to bf16's rounding of the entries;
tests/test_kernels_mixit_streamed.py). Bidirectional tiles hold beta M (its drift averages over t,
not T) and keep the epilogue's centering. The forward walks each (row block, head) over its tiles with
the values of several sequences side by side, the columns of an (n, sequences x d_h) matrix, so one
read of a tile serves the whole group; the identity term is added in its epilogue. The backward is
the same walk over the transposed tiles, dV = A^T G. The sink head 0 and GQA's shared V heads are the
kernels' too (V is not repeated; each of V's heads sums the gradients of the heads that read it, and every
entry of dV is written once), so nothing of the op runs outside them but the bidirectional centering's
column sums. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from .mixit_blocked import MixitParams
from .mixit_triton import sweep_all_tiles

# The stored tile's side: the 64 x 64 tile at 8 warps is what the regenerating kernel compiles without
# spills at every preset head dim (mixit_triton.MAX_TILE), and its loop's draws match one stored tile.
TILE = 64
# Widest accumulator a program keeps: (sequences in its group) x (padded head dim) float32 columns of a
# 64-row block. Compiled for sm_90, 128 columns take 165-252 registers a thread at 8 warps without spills,
# bf16 or float32, forward or backward; 256 spill at 8 warps (255 registers) and at 16 (128 a thread)
# (tests/test_kernels_hopper.py compiles each head dim at its widest group). The groups of one row block
# are neighbours in the launch order, so their reads of the same tile meet in L2.
MAX_WIDTH = 128
# The generator's launch: one 64 x 64 tile a program, 32 draws a thread (compiled without spills, as above)
GENERATE = dict(num_warps=4, num_stages=1)

# kernel argument -> Triton signature type for the ahead-of-time compile (tests/test_kernels_hopper.py);
# "*dt" is the compute dtype (values, output, gradients, tiles), filled in by arg_types
_ARGS = {
    **dict.fromkeys(["A", "V", "O", "G", "DV"], "*dt"),
    **dict.fromkeys(["CS", "RC", "DRIFT", "SIG", "S0"], "*fp32"),
    "KEYS": "*i64",
    "beta": "fp32",
    **dict.fromkeys(["T", "nb", "NT", "B", "n", "row_start"], "i32"),
    **dict.fromkeys(["svb", "svh", "svt", "scb", "sch", "sct", "sob", "soh", "sot", "sdh"], "i32"),
}


def arg_types(dtype: str) -> dict[str, str]:
    """The kernels' argument types with values and tiles in `dtype` ('bf16', 'fp16' or 'fp32')."""
    return {k: v.replace("dt", dtype) for k, v in _ARGS.items()}


def tile_count(T: int, causal: bool) -> int:
    """Tiles stored per head: those on and below the diagonal of a T x T matrix (all when bidirectional)."""
    nb = -(-T // TILE)
    return nb * (nb + 1) // 2 if causal else nb * nb


class Launch(NamedTuple):
    """Launch shape of the forward and backward: padded head dim BD, sequences per program, warps, stages."""

    BD: int
    SEQS: int
    num_warps: int
    num_stages: int


def launch(dh: int, batch: int) -> Launch:
    """Head dim `dh` padded to a power of two (at least 16, tl.dot's minimum), and as many sequences of the
    `batch` per program as MAX_WIDTH allows (a power of two: the accumulator's width must be one)."""
    bd = max(16, 1 << (dh - 1).bit_length())
    seqs = max(1, min(1 << (batch - 1).bit_length(), MAX_WIDTH // bd))
    return Launch(bd, seqs, 8, 3)


def interpreted_bf16(dtype: torch.dtype) -> bool:
    """True for bf16 values under Triton's interpreter, which multiplies tl.dot's bf16 operands as their
    raw 16-bit integers (np.matmul over its uint16 storage, Triton 3.9): the kernels then upcast the
    operands to float32 first, which is exact, as the compiled product of two bf16 numbers is exact in
    its float32 accumulator."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton  # deferred: heavy
    import triton.language as tl  # deferred: heavy

    @triton.jit
    def generate(A, KEYS, SIG, DRIFT, T, nb, beta, sdh, CAUSAL: tl.constexpr, BT: tl.constexpr, RNG4X: tl.constexpr):
        # one program per stored tile k of head h; causal: k = r (r + 1) / 2 + c with c <= r
        k = tl.program_id(0)
        h = tl.program_id(1)
        if CAUSAL:
            r = ((tl.sqrt((8 * k + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
            r = tl.where(r * (r + 1) // 2 > k, r - 1, r)  # the float root may be one off
            r = tl.where((r + 1) * (r + 2) // 2 <= k, r + 1, r)
            c = k - r * (r + 1) // 2
        else:
            r = k // nb
            c = k % nb
        rows = r * BT + tl.arange(0, BT)
        cols = c * BT + tl.arange(0, BT)
        key = tl.load(KEYS + h)
        sigma = tl.load(SIG + h)
        # the draw of mixit_triton's loop for key tile c (so the same numbers; model/rng.py matrix_normals)
        if RNG4X:
            quads = c * (BT // 4) + tl.arange(0, BT // 4)
            n1, n2, n3, n4 = tl.randn4x(key, rows[:, None] * ((T + 3) // 4) + quads[None, :])
            z = tl.reshape(tl.join(tl.join(n1, n3), tl.join(n2, n4)), (BT, BT))
        else:
            z = tl.randn(key, rows[:, None] * T + cols[None, :])
        ok = (rows[:, None] < T) & (cols[None, :] < T)
        if CAUSAL:  # beta (M - drift 1^T): the centering and beta folded into the stored entries
            ok = ok & (cols[None, :] <= rows[:, None])
            drift = tl.load(DRIFT + h * sdh + rows, mask=rows < T, other=0.0)
            m = tl.where(ok, (z * sigma - drift[:, None]) * beta, 0.0)
        else:  # beta M: its centering averages over t, so it stays in the epilogue
            m = tl.where(ok, z * sigma * beta, 0.0)
        base = (h.to(tl.int64) * tl.num_programs(0) + k) * (BT * BT)
        tile = tl.arange(0, BT)[:, None] * BT + tl.arange(0, BT)[None, :]
        tl.store(A + base + tile, m.to(A.dtype.element_ty))

    @triton.jit
    def forward(
        V,
        CS,
        O,
        A,
        DRIFT,
        B,
        n,
        nb,
        NT,
        row_start,
        beta,
        svb,
        svh,
        svt,
        scb,
        sch,
        sct,
        sob,
        soh,
        sot,
        sdh,
        DH: tl.constexpr,
        GROUPS: tl.constexpr,
        IDENT: tl.constexpr,
        CAUSAL: tl.constexpr,
        BT: tl.constexpr,
        BD: tl.constexpr,
        SEQS: tl.constexpr,
        SWEEP_N: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # grid (sequence groups, row blocks, heads): a row block's groups run side by side and share its
        # tiles; the row blocks run longest (last) first. Head mh reads V's head mh // GROUPS (GQA: V's heads
        # shared, not repeated) and, from 1 on, its stored tiles mh - 1; head 0 is the sink:
        # out_i = (v_i + v_0) / 2 for i >= 1, out_0 = v_0 / 2
        grp = tl.program_id(0)
        r = (n + BT - 1) // BT - 1 - tl.program_id(1)
        mh = tl.program_id(2)
        live = mh >= 1  # a head of stored tiles (not the sink)
        hk = tl.maximum(mh - 1, 0)
        kv = mh // GROUPS
        rows = r * BT + tl.arange(0, BT)
        row_ok = (rows >= row_start) & (rows < n)
        w = tl.arange(0, SEQS * BD)  # column w: sequence grp * SEQS + w // BD, feature w % BD
        seq = grp * SEQS + w // BD
        d = w % BD
        w_ok = (seq < B) & (d < DH)
        v_base = V + kv * svh
        v_cols = seq * svb + d
        tile = tl.arange(0, BT)[:, None] * BT + tl.arange(0, BT)[None, :]
        if CAUSAL:
            hi = tl.where(live, r + 1, 0)
            a_base = A + (hk.to(tl.int64) * NT + r * (r + 1) // 2) * (BT * BT)
        else:
            hi = tl.where(live, (n + BT - 1) // BT, 0)
            a_base = A + (hk.to(tl.int64) * NT + r * nb) * (BT * BT)
        acc = tl.zeros((BT, SEQS * BD), dtype=tl.float32)
        # SWEEP_N: every key tile to a constant bound, the tiles past hi masked (mixit_triton.sweep_all_tiles)
        for c in range(0, SWEEP_N if SWEEP_N else hi):
            keys = c * BT + tl.arange(0, BT)
            if SWEEP_N:
                a = tl.load(a_base + c * (BT * BT) + tile, mask=keys[None, :] < hi * BT, other=0.0)
            else:
                a = tl.load(a_base + c * (BT * BT) + tile)
            vb = tl.load(
                v_base + keys[:, None] * svt + v_cols[None, :], mask=(keys[:, None] < n) & w_ok[None, :], other=0.0
            )
            if UPCAST:  # interpreted_bf16
                a, vb = a.to(tl.float32), vb.to(tl.float32)
            acc = tl.dot(a, vb, acc)
        ok = row_ok[:, None] & w_ok[None, :]
        if CAUSAL:  # the tiles hold beta (M - drift 1^T)
            out = acc
        else:  # the tiles hold beta M
            cs = tl.load(CS + kv * sch + rows[:, None] * sct + (seq * scb + d)[None, :], mask=ok, other=0.0)
            drift = tl.load(DRIFT + hk * sdh + rows, mask=row_ok, other=0.0)
            out = acc - beta * drift[:, None] * cs
        own = tl.load(v_base + rows[:, None] * svt + v_cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if IDENT:
            out += own
        first = tl.load(v_base + v_cols, mask=w_ok, other=0.0).to(tl.float32)  # v_0, the sink's column
        sink = 0.5 * own + tl.where(rows[:, None] >= 1, 0.5 * first[None, :], 0.0)
        out = tl.where(live, out, sink)
        o_ptr = O + mh * soh + (rows[:, None] - row_start) * sot + (seq * sob + d)[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=ok)

    @triton.jit
    def backward(
        G,
        RC,
        DV,
        A,
        S0,
        B,
        n,
        nb,
        NT,
        beta,
        svb,
        svh,
        svt,
        scb,
        sch,
        sct,
        sob,
        soh,
        sot,
        DH: tl.constexpr,
        GROUPS: tl.constexpr,
        IDENT: tl.constexpr,
        CAUSAL: tl.constexpr,
        BT: tl.constexpr,
        BD: tl.constexpr,
        SEQS: tl.constexpr,
        SWEEP_N: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # causal: dV_j = sum_{i >= j} A'[i, j] G_i + G_j with the stored A' = beta (M - drift 1^T);
        # bidirectional: dV_j = sum_i A'[i, j] G_i - beta RC + G_j, A' = beta M, RC = sum_i drift_i G_i (the
        # same for every j; RC holds beta RC summed over each V head's heads).
        # grid (sequence groups, key blocks, V's heads), the longest walk (key block 0 when causal) first: a
        # program sums dV over the GROUPS heads that read its V head (GQA), the sink head 0 among them for V's
        # head 0 (dV_j = G_0,j / 2, and at j = 0 the caller's S0: the sum of G_0,i / 2 over i >= 1, a reduction
        # over every row that would cost this loop registers). G's strides are sv*, RC's sc*, DV's so*; every
        # entry of DV is written once (no zero fill, rounded once)
        grp = tl.program_id(0)
        c = tl.program_id(1)
        kv = tl.program_id(2)
        cols = c * BT + tl.arange(0, BT)
        col_ok = cols < n
        w = tl.arange(0, SEQS * BD)
        seq = grp * SEQS + w // BD
        d = w % BD
        w_ok = (seq < B) & (d < DH)
        g_cols = seq * svb + d
        ok = col_ok[:, None] & w_ok[None, :]
        tile = tl.arange(0, BT)[:, None] * BT + tl.arange(0, BT)[None, :]
        lo = c if CAUSAL else 0
        # the identity's, the centering's and the sink's terms go straight into acc (the tiles hold beta):
        # no second accumulator live across the loop
        acc = tl.zeros((BT, SEQS * BD), dtype=tl.float32)
        # one loop over (head, row block) pairs of the group's heads of stored tiles (the sink, head 0, has
        # none): a single pipelined loop, as without GQA (a loop over heads around it spilled registers)
        nblk = (n + BT - 1) // BT
        span = nblk - lo  # row blocks each head walks
        first = tl.where(kv == 0, 1, 0)  # V's head 0: its heads from 1 (head 0 is the sink)
        for it in range(0, GROUPS * SWEEP_N if SWEEP_N else (GROUPS - first) * span):
            if SWEEP_N:
                mh = kv * GROUPS + it // SWEEP_N
                r = it % SWEEP_N
            else:
                mh = kv * GROUPS + first + it // span
                r = lo + it % span
            hk = tl.maximum(mh - 1, 0)
            if CAUSAL:
                a_ptr = A + hk.to(tl.int64) * NT * (BT * BT) + (r * (r + 1) // 2 + c) * (BT * BT) + tile
            else:
                a_ptr = A + hk.to(tl.int64) * NT * (BT * BT) + (r * nb + c) * (BT * BT) + tile
            rows = r * BT + tl.arange(0, BT)
            if SWEEP_N:
                a = tl.where(mh >= 1, tl.load(a_ptr, mask=rows[:, None] >= lo * BT, other=0.0), 0.0)
            else:
                a = tl.load(a_ptr)
            gb = tl.load(
                G + mh * svh + rows[:, None] * svt + g_cols[None, :],
                mask=(rows[:, None] < n) & w_ok[None, :],
                other=0.0,
            )
            if UPCAST:  # interpreted_bf16
                a, gb = a.to(tl.float32), gb.to(tl.float32)
            acc = tl.dot(tl.trans(a), gb, acc)
        for j in range(GROUPS):  # the identity's and the sink's terms of each head
            mh = kv * GROUPS + j
            live = mh >= 1
            g_base = G + mh * svh
            own = tl.load(g_base + cols[:, None] * svt + g_cols[None, :], mask=ok, other=0.0).to(tl.float32)
            if IDENT:
                term = tl.where(live, own, 0.5 * own)
            else:
                term = tl.where(live, 0.0, 0.5 * own)
            acc += term
        if not CAUSAL:  # the centering: beta RC summed over the group's heads by the caller
            acc -= tl.load(RC + kv * sch + cols[:, None] * sct + (seq * scb + d)[None, :], mask=ok, other=0.0)
        # the sink's column 0 (A_0[i, 0] = 1/2, i >= 1): S0, half the sum of G_0,i over those rows (the caller's)
        s0 = tl.where((kv == 0) & (c == 0), tl.load(S0 + seq * DH + d, mask=w_ok, other=0.0), 0.0)
        acc += tl.where(cols[:, None] == 0, s0[None, :], 0.0)
        tl.store(DV + kv * soh + cols[:, None] * sot + (seq * sob + d)[None, :], acc.to(DV.dtype.element_ty), mask=ok)

    return generate, forward, backward


def generate_tiles(p: MixitParams, dtype: torch.dtype, device, drift: torch.Tensor | None = None) -> torch.Tensor:
    """The stored tiles of heads 1..H-1 as (H-1, tile_count, TILE, TILE) in `dtype`: causal, beta (M - drift
    1^T) with `drift` (H-1, T) from mixit_blocked.compute_drift (computed in float32, rounded once);
    bidirectional, beta M. Tile k of a head is row block r, key block c with k = r (r + 1) / 2 + c when causal
    (c <= r), k = r * ceil(T / TILE) + c otherwise; entries past T, and above the diagonal when causal,
    are zero."""
    hr = len(p.keys)
    nt = tile_count(p.T, p.causal)
    tiles = torch.empty(hr, nt, TILE, TILE, dtype=dtype, device=device)
    if p.causal and hr and (drift is None or tuple(drift.shape) != (hr, p.T)):
        raise ValueError(f"causal tiles fold the drift in: pass compute_drift(p, {p.T}, ...), shape ({hr}, {p.T})")
    if hr:
        keys = torch.tensor(p.keys, dtype=torch.int64, device=device)
        sig = torch.tensor(p.sigmas, dtype=torch.float32, device=device)
        drift = sig if drift is None else drift.to(device=device, dtype=torch.float32)  # bidirectional: unread
        sdh = drift.stride(0) if drift.dim() == 2 else 0
        meta = dict(CAUSAL=p.causal, BT=TILE, RNG4X=p.generator == "philox4x", **GENERATE)
        _kernels()[0][(nt, hr)](tiles, keys, sig, drift, p.T, -(-p.T // TILE), p.beta, sdh, **meta)
    return tiles


def _check(tiles: torch.Tensor, p: MixitParams, x: torch.Tensor) -> None:
    shape = (len(p.keys), tile_count(p.T, p.causal), TILE, TILE)
    if tiles.dtype != x.dtype or tuple(tiles.shape) != shape or not tiles.is_contiguous():
        raise ValueError(f"tiles {tuple(tiles.shape)} {tiles.dtype} do not fit values {x.dtype}: need {shape}")


def _meta(p: MixitParams, dh: int, n: int, lc: Launch, dtype: torch.dtype, groups: int) -> dict:
    """The compile-time and launch keywords of the forward and backward over n rows."""
    return dict(
        DH=dh,
        GROUPS=groups,
        IDENT=p.identity,
        CAUSAL=p.causal,
        BT=TILE,
        BD=lc.BD,
        SEQS=lc.SEQS,
        SWEEP_N=-(-n // TILE) if sweep_all_tiles() else 0,
        UPCAST=interpreted_bf16(dtype),
        num_warps=lc.num_warps,
        num_stages=lc.num_stages,
    )


def heads_forward(
    tiles: torch.Tensor,
    p: MixitParams,
    v: torch.Tensor,
    drift: torch.Tensor,
    row_start: int,
    out: torch.Tensor,
    groups: int = 1,
) -> None:
    """Every head, the sink head 0 and the stored tiles' 1..H-1: writes A V for rows row_start..n-1 of v
    (b, H / groups, n, dh: head h reads v's head h // groups) into out (b, H, n - row_start, dh); v, out and
    the tiles in one dtype, accumulated in float32."""
    _check(tiles, p, v)
    b, kvh, n, dh = v.shape
    # bidirectional: the centering's column sums; causal tiles hold it already (CS is then not read)
    cs = v if p.causal else v.float().sum(2, keepdim=True).expand(b, kvh, n, dh)
    lc = launch(dh, b)
    grid = (-(-b // lc.SEQS), -(-n // TILE) - row_start // TILE, out.shape[1])
    strides = (*v.stride()[:3], *cs.stride()[:3], *out.stride()[:3], drift.stride(0))
    meta = _meta(p, dh, n, lc, v.dtype, groups)
    nt, nb = tile_count(p.T, p.causal), -(-p.T // TILE)
    _kernels()[1][grid](v, cs, out, tiles, drift, b, n, nb, nt, row_start, p.beta, *strides, **meta)


def heads_backward(
    tiles: torch.Tensor, p: MixitParams, g: torch.Tensor, drift: torch.Tensor, dv: torch.Tensor, groups: int = 1
) -> None:
    """Rows from 0: writes dV = A^T g of g (b, H, n, dh) into every entry of dv (b, H / groups, n, dh), each of
    v's heads summing the heads that read it (GQA), the sink head 0's term included."""
    _check(tiles, p, g)
    b, heads, n, dh = g.shape
    if p.causal or heads == 1:  # the tiles hold the centering (RC is then not read)
        rc = g
    else:  # beta sum_i drift_i g_i of each head, summed over the heads that read each of v's heads
        rc = p.beta * (drift[None, :, :n, None] * g[:, 1:].float()).sum(2, keepdim=True)
        rc = torch.cat([torch.zeros_like(rc[:, :1]), rc], 1)  # the sink head 0: no centering
        rc = rc.view(b, heads // groups, groups, 1, dh).sum(2).expand(b, heads // groups, n, dh)
    lc = launch(dh, b)
    grid = (-(-b // lc.SEQS), -(-n // TILE), dv.shape[1])
    strides = (*g.stride()[:3], *rc.stride()[:3], *dv.stride()[:3])
    meta = _meta(p, dh, n, lc, g.dtype, groups)
    nt, nb = tile_count(p.T, p.causal), -(-p.T // TILE)
    # the sink's column 0 (A_0[i, 0] = 1/2 for every i >= 1): half the sum of its gradient over those rows
    s0 = (0.5 * g[:, 0, 1:].sum(1, dtype=torch.float32)).contiguous()
    _kernels()[2][grid](g, rc, dv, tiles, s0, b, n, nb, nt, p.beta, *strides, **meta)


def _innermost_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class StreamedMixing(torch.autograd.Function):
    """A V with every head in the kernels: the random heads streamed from stored tiles, the sink head 0, V's
    heads shared under GQA (not repeated); A is fixed, so the backward is dV = A^T dO and the tiles take no
    gradient."""

    @staticmethod
    def forward(ctx, v, tiles, p, drift, row_start, groups):
        ctx.tiles, ctx.p, ctx.drift, ctx.row_start, ctx.groups = tiles, p, drift, row_start, groups
        v = _innermost_contiguous(v)
        b, kvh, n, dh = v.shape
        heads = kvh * groups
        # (b, t, H, dh) in memory: the layer's transpose back to (b, t, hidden) is then a view
        out = torch.empty(b, n - row_start, heads, dh, dtype=v.dtype, device=v.device).transpose(1, 2)
        heads_forward(tiles, p, v, drift, row_start, out, groups)
        return out

    @staticmethod
    def backward(ctx, g):
        if ctx.row_start:
            raise NotImplementedError("MixiT streamed backward with a KV-cache offset (decoding is inference-only)")
        g = _innermost_contiguous(g)
        b, heads, n, dh = g.shape
        dv = torch.empty(b, n, heads // ctx.groups, dh, dtype=g.dtype, device=g.device).transpose(1, 2)
        heads_backward(ctx.tiles, ctx.p, g, ctx.drift, dv, ctx.groups)
        return dv, None, None, None, None, None


def mixit_streamed(
    v: torch.Tensor, tiles: torch.Tensor, p: MixitParams, drift: torch.Tensor, row_start: int = 0, groups: int = 1
) -> torch.Tensor:
    """A V for rows row_start..n-1 of every head, (b, H, n - row_start, dh), from v: (b, H / groups, n, dh)
    (GQA: head h reads v's head h // groups), with `tiles` from generate_tiles in v's dtype and drift from
    mixit_blocked.compute_drift; with groups 1, the same contract as mixit_blocked."""
    return StreamedMixing.apply(v, tiles, p, drift, row_start, groups)
