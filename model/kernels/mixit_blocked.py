"""MixiT mixing without materialising A: the memory-light PyTorch path (the algebra, shared with the
Triton path: docs/PERFORMANCE.md).

M is regenerated slab by slab from the counter-based RNG (rows [r0, r0 + block) x the columns those
rows see), so memory is O(t * block) per head instead of O(t^2); drift_h is an O(T) vector computed
the same way once and cached by the caller. A is fixed, so the backward pass needs only dV = A^T dO:
nothing is saved for it. Row offsets (`row_start`) serve incremental decoding: rows row_start..n-1
against keys 0..n-1.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..mixit import head_sigmas
from ..rng import matrix_normals, mixit_key


class MixitParams:
    """Per-layer constants of the random heads 1..H-1: Philox keys, sigmas (H-1 of each)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        self.cfg, self.layer = cfg, layer
        H = cfg.num_heads
        self.keys = [mixit_key(cfg.mixit_seed, layer, h) for h in range(1, H)]
        self.sigmas = [float(s) for s in head_sigmas(cfg, layer)[1:].float()]
        self.beta = float(cfg.mixit_beta)
        self.identity = cfg.mixit_depth_alpha == 0
        self.causal = cfg.causal
        self.T = cfg.max_seq_len
        self.generator = cfg.mixit_rng

    def key_tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.keys, dtype=torch.int64, device=device).view(-1, 1, 1)

    def sigma_tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.sigmas, dtype=torch.float32, device=device).view(-1, 1, 1)


def raw_slab(p: MixitParams, rows: torch.Tensor, ncols: int, keys: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """sigma_h * z_h[i, j] for heads 1..H-1, i in rows, j < ncols: (H-1, len(rows), ncols) float32.

    The same numbers as mixit.raw_block (Philox is evaluated with a per-head key tensor)."""
    cols = torch.arange(ncols, device=rows.device, dtype=torch.int64)
    return matrix_normals(keys, rows, cols, p.T, p.generator) * sigmas


def slabs(p: MixitParams, row_start: int, n: int, block: int, dtype, device):
    """Per block of rows r0..: (r0, the rows, their slab of M (the columns they see) in dtype, causally
    masked, its column count), for rows row_start..n-1."""
    keys, sigmas = p.key_tensor(device), p.sigma_tensor(device)
    for r0 in range(row_start, n, block):
        r1 = min(r0 + block, n)
        rows = torch.arange(r0, r1, device=device)
        ncols = r1 if p.causal else n  # from Python ints: no read of the device
        m = raw_slab(p, rows, ncols, keys, sigmas).to(dtype)
        if p.causal:
            m = m * (torch.arange(ncols, device=device)[None, :] <= rows[:, None])
        yield r0, rows, m, ncols


def compute_drift(p: MixitParams, n: int, device, block: int) -> torch.Tensor:
    """drift_h[i] for heads 1..H-1 and i < n: (H-1, n) float32.

    Causal: mean of M_h[i, :i+1] (independent of n, so drift for T serves every t <= T).
    Bidirectional: mean of M_h[i, :n] (depends on n)."""
    out = torch.empty(len(p.keys), n, dtype=torch.float32, device=device)
    for r0, rows, m, _ in slabs(p, 0, n, block, torch.float32, device):
        count = (rows + 1).to(torch.float32) if p.causal else torch.full((len(rows),), float(n), device=device)
        out[:, r0 : r0 + len(rows)] = m.sum(-1) / count
    return out


# ---- the sink head (head 0): A_0[i, i] = A_0[i, 0] = 1/2 ---------------------------------
def sink_forward(v0: torch.Tensor, row_start: int) -> torch.Tensor:
    """v0: (b, n, dh) values of head 0 -> (b, n - row_start, dh)."""
    out = 0.5 * v0[:, row_start:]
    out[:, 1 if row_start == 0 else 0 :] += 0.5 * v0[:, :1]  # row 0 is its own sink
    return out


def sink_backward(g0: torch.Tensor, row_start: int, n: int) -> torch.Tensor:
    """g0: (b, n - row_start, dh) output gradients of head 0 -> dV_0 (b, n, dh)."""
    dv = torch.zeros(g0.shape[0], n, g0.shape[2], dtype=g0.dtype, device=g0.device)
    dv[:, row_start:] = 0.5 * g0
    first = max(row_start, 1) - row_start  # rows i >= 1 also feed column 0
    dv[:, 0] += 0.5 * g0[:, first:].sum(1)
    return dv


def cumsum_rows(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Prefix sums of (b, H, n, dh) along n (suffix sums when `reverse`), as a contiguous tensor.

    Scanned with n innermost: CUDA's scan over an outer dimension gives one thread to each of the
    b*H*dh columns and walks n in sequence (3 ms at 31 x 8192 x 64 on an H200, a fifth of MixiT's
    Triton step); the innermost scan runs in parallel along n."""
    rows = x.transpose(-1, -2).contiguous()
    rows = rows.flip(-1).cumsum(-1).flip(-1) if reverse else rows.cumsum(-1)
    return rows.transpose(-1, -2).contiguous()


# ---- the random heads 1..H-1 --------------------------------------------------------------
def kv_heads(p: MixitParams, groups: int, device) -> torch.Tensor | slice:
    """V's head that each random head 1..H-1 reads (h // groups): an index, or a slice without GQA."""
    n = len(p.keys)
    return slice(1, n + 1) if groups == 1 else torch.arange(1, n + 1, device=device) // groups


def mix_slab(m: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """M V for one slab: m (H-1, rows, ncols), v (b, H / groups, ncols, dh) -> (b, H-1, rows, dh), head h
    against V's head h // groups. With GQA the slab gains a zero head 0 and stacks each group's rows, so one
    product per V head reads it once (V is never repeated to every head)."""
    if groups == 1:
        return torch.matmul(m, v[:, 1:])
    rows, ncols = m.shape[1:]
    full = torch.cat([m.new_zeros(1, rows, ncols), m]).view(v.shape[1], groups * rows, ncols)
    return torch.matmul(full, v).view(v.shape[0], -1, rows, v.shape[3])[:, 1:]


def blocked_forward(
    p: MixitParams, v: torch.Tensor, drift: torch.Tensor, row_start: int, block: int, groups: int = 1
) -> torch.Tensor:
    """v: (b, H / groups, n, dh) float32, every head's values (head 0's too); drift (H-1, >=n) ->
    (b, H-1, n - row_start, dh) for the random heads."""
    n = v.shape[2]
    dev = v.device
    kv = kv_heads(p, groups, dev)
    cs = cumsum_rows(v) if p.causal else v.sum(2, keepdim=True).expand_as(v)
    out = torch.empty(v.shape[0], len(p.keys), n - row_start, v.shape[3], dtype=v.dtype, device=dev)
    for r0, rows, m, ncols in slabs(p, row_start, n, block, v.dtype, dev):
        mv = mix_slab(m, v[:, :, :ncols], groups)  # (b, H-1, rows, dh)
        sl = slice(r0, r0 + len(rows))
        o = p.beta * (mv - drift[None, :, sl, None].to(v.dtype) * cs[:, kv, sl])
        if p.identity:
            o = o + v[:, kv, sl]
        out[:, :, r0 - row_start : r0 - row_start + len(rows)] = o
    return out


def blocked_backward(
    p: MixitParams, g: torch.Tensor, drift: torch.Tensor, row_start: int, n: int, block: int
) -> torch.Tensor:
    """g: (b, H-1, n - row_start, dh) float32 -> dV (b, H-1, n, dh) = A^T g."""
    dev = g.device
    b, Hr, _, dh = g.shape
    dv = torch.zeros(b, Hr, n, dh, dtype=g.dtype, device=dev)
    dg = drift[None, :, row_start:n, None].to(g.dtype) * g  # drift_i G_i
    if p.causal:
        rc = cumsum_rows(dg, reverse=True)  # sum_{i >= j, i in rows}
        dv[:, :, row_start:] -= p.beta * rc
        if row_start > 0:
            dv[:, :, :row_start] -= p.beta * rc[:, :, :1]
    else:
        dv -= p.beta * dg.sum(2, keepdim=True)
    if p.identity:
        dv[:, :, row_start:] += g
    for r0, rows, m, ncols in slabs(p, row_start, n, block, g.dtype, dev):
        gi = g[:, :, r0 - row_start : r0 - row_start + len(rows)]
        dv[:, :, :ncols] += p.beta * torch.matmul(m.transpose(-1, -2), gi)
    return dv


def _work(x: torch.Tensor) -> torch.Tensor:
    """Compute in float32, or float64 when given float64 (gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


class SinkAndRandomHeads(torch.autograd.Function):
    """A V: the sink head elementwise, the random heads 1..H-1 by `heads`, a (forward, backward) pair
    (blocked_forward and blocked_backward above, or the Triton kernels' in mixit_triton.py). With GQA
    (`groups` heads a V head) the forward reads V's shared heads and the backward sums each group's dV."""

    @staticmethod
    def forward(ctx, v, p, drift, row_start, block, heads, groups):
        ctx.p, ctx.drift, ctx.row_start, ctx.block, ctx.n, ctx.dtype = p, drift, row_start, block, v.shape[2], v.dtype
        ctx.heads, ctx.groups = heads, groups
        vf = _work(v)
        out0 = sink_forward(vf[:, 0], row_start)
        if p.keys:
            rest = heads[0](p, vf, drift, row_start, block, groups)
        else:
            rest = vf.new_zeros(v.shape[0], 0, v.shape[2] - row_start, v.shape[3])
        return torch.cat([out0[:, None], rest], 1).to(v.dtype)

    @staticmethod
    def backward(ctx, g):
        gf = _work(g)
        dv0 = sink_backward(gf[:, 0], ctx.row_start, ctx.n)
        if g.shape[1] > 1:
            rest = ctx.heads[1](ctx.p, gf[:, 1:], ctx.drift, ctx.row_start, ctx.n, ctx.block)
        else:
            rest = gf.new_zeros(g.shape[0], 0, ctx.n, g.shape[3])
        dv = torch.cat([dv0[:, None], rest], 1)  # (b, H, n, dh): every head's share
        if ctx.groups > 1:
            dv = dv.unflatten(1, (-1, ctx.groups)).sum(2)
        return dv.to(ctx.dtype), None, None, None, None, None, None


def mixit_blocked(
    v: torch.Tensor, p: MixitParams, drift: torch.Tensor, row_start: int = 0, block: int = 128, groups: int = 1
) -> torch.Tensor:
    """A V for rows row_start..n-1 (A the layer's mixing matrices), v: (b, H / groups, n, dh), head h
    mixing V's head h // groups (GQA); out (b, H, n - row_start, dh).

    drift: (H-1, >= n) from compute_drift (causal: for any n' >= n; bidirectional: for n)."""
    return SinkAndRandomHeads.apply(v, p, drift, row_start, block, (blocked_forward, blocked_backward), groups)
