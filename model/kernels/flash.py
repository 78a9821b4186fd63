"""flash-attn 2 wrapper, used automatically on CUDA when the package is installed."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q: (b, H, t, dh), k/v: (b, H_kv, t, dh) -> (b, H, t, dh). GQA is handled by flash-attn itself."""
    from flash_attn import flash_attn_func
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    return out.transpose(1, 2)
