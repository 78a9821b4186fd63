"""flash-attn 2 wrapper, used automatically on CUDA when the package is installed."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401  # deferred: optional, probed
    except ImportError:
        return False
    return True


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float | None = None
) -> torch.Tensor:
    """q: (b, H, t, dh), k/v: (b, H_kv, t, dh) -> (b, H, t, dh). GQA is handled by flash-attn itself."""
    from flash_attn import flash_attn_func  # deferred: heavy

    out = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=softmax_scale
    )
    return out.transpose(1, 2)


def segments_from_mask(attn_mask: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens (int32, over the flattened batch) when attn_mask (b, t, t) is exactly the
    block-diagonal mask of contiguous documents, else None (the caller falls back to SDPA)."""
    b, t, _ = attn_mask.shape
    starts = torch.ones(b, t, dtype=torch.bool, device=attn_mask.device)
    if t > 1:
        idx = torch.arange(1, t, device=attn_mask.device)
        starts[:, 1:] = ~attn_mask[:, idx, idx - 1]
    seg = starts.long().cumsum(1)
    if not torch.equal(seg[:, :, None] == seg[:, None, :], attn_mask):
        return None
    flat = torch.nonzero(starts.flatten()).flatten()
    end = torch.tensor([b * t], device=attn_mask.device)
    return torch.cat([flat, end]).to(torch.int32)


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Packed documents: q (b, H, t, dh), k/v (b, H_kv, t, dh); attention stays inside each segment."""
    from flash_attn import flash_attn_varlen_func  # deferred: heavy

    b, H, t, dh = q.shape
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

    def flat(x):
        return x.transpose(1, 2).reshape(b * t, x.shape[1], dh)

    out = flash_attn_varlen_func(
        flat(q), flat(k), flat(v), cu_seqlens, cu_seqlens, max_len, max_len, causal=causal, softmax_scale=softmax_scale
    )
    return out.view(b, t, H, dh).transpose(1, 2)
