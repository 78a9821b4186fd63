"""Next-token loss without full-vocabulary logits for the whole batch at once.

`linear_cross_entropy(h, W, labels)` = cross_entropy((h @ W^T).float(), labels), mean over
scored tokens (IGNORE_INDEX skipped), computed `chunk` tokens at a time. The gradients
w.r.t. h and W are produced chunk by chunk in the forward pass (the loss is a scalar,
so backward only rescales them), hence at most chunk x vocab logits are ever alive.
Weight gradients are computed only when W trains, input gradients only when h needs them.
On CUDA, Liger's fused linear cross-entropy is used instead when it is installed.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@functools.lru_cache(maxsize=1)
def liger_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss  # noqa: F401
    except Exception:
        return False
    return True


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk, ignore_index):
        n = h.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        count = (labels != ignore_index).sum()
        acc = torch.promote_types(h.dtype, torch.float32)         # fp32 logits, or fp64 for fp64 inputs
        denom = count.clamp(min=1).to(acc)
        total = torch.zeros((), dtype=acc, device=h.device)
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for s in range(0, n, chunk):
            hc, yc = h[s:s + chunk], labels[s:s + chunk]
            logits = (hc @ weight.t()).to(acc)
            total = total + F.cross_entropy(logits, yc, ignore_index=ignore_index, reduction="sum")
            if need_h or need_w:
                valid = yc != ignore_index
                grad = logits.softmax(-1)
                grad[valid, yc[valid]] -= 1.0
                grad[~valid] = 0.0
                grad = (grad / denom).to(h.dtype)
                if need_h:
                    gh[s:s + chunk] = grad @ weight
                if need_w:
                    gw += (grad.t() @ hc).to(acc)
        ctx.save_for_backward(gh if need_h else None, gw.to(weight.dtype) if need_w else None)
        # mean over scored tokens; nan when none is scored, like F.cross_entropy
        return total / count.to(acc)

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return (None if gh is None else gh * g.to(gh.dtype), None if gw is None else gw * g.to(gw.dtype),
                None, None, None)


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk: int = 4096, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """h: (n, d), weight: (vocab, d), labels: (n,) -> mean cross-entropy over scored tokens."""
    return _ChunkedLinearCE.apply(h, weight, labels, chunk, ignore_index)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The loss backend for the model: Liger on CUDA when installed, else the chunked path."""
    from .select import log_choice
    if h.is_cuda and liger_available():
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        log_choice("loss", "liger", "CUDA, liger-kernel installed")
        return LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index)(weight, h, labels)
    log_choice("loss", "chunked", f"{chunk} tokens per chunk")
    return chunked_linear_cross_entropy(h, weight, labels, chunk, ignore_index)
