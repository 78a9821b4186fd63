"""Next-token loss without full-vocabulary logits for the whole batch at once (docs/PERFORMANCE.md).

`linear_cross_entropy(h, W, labels)` = cross_entropy((h @ W^T).float(), labels), the mean (or sum)
over scored tokens, computed `chunk` tokens at a time. The gradients w.r.t. h and W (each only when
needed) are produced chunk by chunk in the forward pass (the loss is a scalar, so backward only
rescales them), hence at most chunk x vocab logits are ever alive. Nothing in the loop waits for the
device, so on a GPU the chunks queue back to back. On CUDA, Liger's fused kernel is used when installed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from common.constants import IGNORE_INDEX

from .select import log_choice


@functools.lru_cache(maxsize=1)
def liger_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss  # noqa: F401  # deferred: optional, probed
    except Exception:
        return False
    return True


_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _workspace(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (chunk, vocab) buffer. On CPU it is kept between steps: a fresh one is mostly page
    faults (~30 ms for 1024 x 32000 fp32). CUDA's caching allocator already reuses memory."""
    if device.type != "cpu":
        return torch.empty(rows, cols, dtype=dtype, device=device)
    buf = _WORKSPACE.get((dtype, cols))
    if buf is None or buf.shape[0] < rows:
        buf = _WORKSPACE[(dtype, cols)] = torch.empty(rows, cols, dtype=dtype)
    return buf[:rows]


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, ignore_index, reduction):
        n = h.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        valid = labels != ignore_index
        count = valid.sum()
        acc = torch.promote_types(h.dtype, torch.float32)  # fp32 logits, or fp64 for fp64 inputs
        # Each token's gradient weight: 1/count (mean) or 1 (sum) when scored, 0 when ignored. It
        # scales the (chunk, d) side of each matmul, never the (chunk, vocab) logits.
        row_w = valid.to(acc) / count.clamp(min=1).to(acc) if reduction == "mean" else valid.to(acc)
        target = torch.where(valid, labels, 0)
        total = torch.zeros((), dtype=acc, device=h.device)
        gh = torch.empty_like(h) if need_h else None
        gw = torch.empty(weight.shape, dtype=acc, device=weight.device) if need_w else None
        # One (chunk, vocab) buffer serves every chunk: logits, then softmax, then the logits'
        # gradient, all in place.
        buf = _workspace(min(chunk, n), weight.shape[0], acc, h.device)
        for s in range(0, n, chunk):
            hc, yc, vc = h[s : s + chunk], target[s : s + chunk], valid[s : s + chunk]
            rows = torch.arange(hc.shape[0], device=h.device)
            z = buf[: hc.shape[0]]
            if weight.dtype == acc:
                torch.mm(hc, weight.t(), out=z)
            else:
                z.copy_(hc @ weight.t())
            # -log p_y = logsumexp(z) - z_y, taken in log_softmax's form so that it stays exact
            # where p_y underflows (a loss above ~87 nats in fp32): logsumexp(z) = max(z) - log p_max,
            # and p_max >= 1/vocab never underflows. ATen's softmax (one pass per row, in place) is
            # ~3x faster on CPU than amax/sub/exp/sum/div; the two amax passes add ~1/4 of it.
            z_max, z_target = z.amax(-1), z[rows, yc]
            p = torch.softmax(z, -1, out=z)
            nll = (z_max - z_target) - p.amax(-1).log()
            total = total + torch.where(vc, nll, 0).sum()
            if need_h or need_w:
                grad = p
                grad[rows, yc] -= 1.0  # d(-log p_y)/d logits
                grad = grad.to(h.dtype)
                wc = row_w[s : s + chunk, None]
                if need_h:
                    torch.mm(grad, weight, out=gh[s : s + chunk]).mul_(wc.to(h.dtype))
                if need_w:
                    hw = hc * wc.to(hc.dtype)
                    if gw.dtype == grad.dtype:  # in place (and seen by FLOP counters); the first chunk overwrites
                        torch.addmm(gw, grad.t(), hw, beta=0 if s == 0 else 1, out=gw)
                    elif s == 0:
                        gw.copy_(grad.t() @ hw)
                    else:
                        gw += (grad.t() @ hw).to(acc)
        if need_w and n == 0:
            gw.zero_()
        ctx.save_for_backward(gh if need_h else None, gw.to(weight.dtype) if need_w else None)
        # mean over scored tokens (nan when none is scored, like F.cross_entropy), or the sum
        return total / count.to(acc) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        dh = None if gh is None else gh * g.to(gh.dtype)
        dw = None if gw is None else gw * g.to(gw.dtype)
        return dh, dw, None, None, None, None


REDUCTIONS = ("mean", "sum")


def chunked_linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int = 4096,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """h: (n, d), weight: (vocab, d), labels: (n,) -> cross-entropy over scored tokens (mean or sum)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    return _ChunkedLinearCE.apply(h, weight, labels, chunk, ignore_index, reduction)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """The loss backend for the model: Liger on CUDA when installed, else the chunked path;
    `chunk` 0 asks for the full (n, vocab) logits (the plain reference)."""
    if not chunk:
        log_choice("loss", "full logits", "loss_chunk_tokens=0")
        logits = (h @ weight.t()).to(torch.promote_types(h.dtype, torch.float32))
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
    if h.is_cuda and liger_available():
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,  # deferred: heavy
        )

        log_choice("loss", "liger", "CUDA, liger-kernel installed")
        return LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)(weight, h, labels)
    log_choice("loss", "chunked", f"{chunk} tokens per chunk")
    return chunked_linear_cross_entropy(h, weight, labels, chunk, ignore_index, reduction)
