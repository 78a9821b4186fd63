"""The in-context learning score (Olsson et al. 2022, "In-context Learning and Induction Heads").

Olsson et al. define it as the loss of the 500th token of a context minus the loss of the 50th,
averaged over many contexts of real text: negative when tokens late in a context are predicted
better than early ones, i.e. when the model uses what it read earlier. Its sharp drop during
training is the phase change that coincides with the formation of induction heads.

Here the context is any window of `window` tokens (max_seq_len + 1 by default: the model reads
max_seq_len of them), so the two positions scale with it: token k_early = round(window * 50/512)
and k_late = round(window * 500/512) (50 and 500 at Olsson's 512). Each is averaged over a band of +-`band` tokens
(window // 32 by default) to reduce noise. Token k is predicted from tokens 0..k-1 of its window;
windows are consecutive, non-overlapping slices of the held-out stream, starting at its first token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common.errors import EvalError

EARLY, LATE, OLSSON_CONTEXT = 50, 500, 512


@torch.no_grad()
def loss_by_position(model, tokens, window: int, n_windows: int, batch_size: int = 8) -> torch.Tensor:
    """Mean next-token loss (nats) of token k = 1..window-1 of each window, over `n_windows` windows:
    a float64 tensor whose entry k-1 is the loss of token k."""
    device = next(model.parameters()).device
    t = torch.as_tensor(np.array(tokens, dtype=np.int64))  # a copy: the caller's array may be read-only
    if window < 2 or window - 1 > model.cfg.max_seq_len:
        raise EvalError(
            f"icl: a window of {window} tokens needs 2 <= window <= max_seq_len + 1 ({model.cfg.max_seq_len + 1})"
        )
    n = min(n_windows, t.numel() // window)
    if n < 1:
        raise EvalError(
            f"icl: the text has {t.numel()} tokens, fewer than one window of {window}. Fix: give more "
            "text or a shorter --window"
        )
    if int(t[: n * window].max()) >= model.cfg.vocab_size:
        raise EvalError(
            f"icl: token id {int(t.max())} is outside the model vocabulary ({model.cfg.vocab_size}); "
            "the tokenizer does not match the checkpoint. Fix: the tokenizer it was trained with (omit --tokenizer)"
        )
    total = torch.zeros(window - 1, dtype=torch.float64)
    for i in range(0, n, batch_size):
        x = t[i * window : min(n, i + batch_size) * window].view(-1, window).to(device)
        logp = F.log_softmax(model(x[:, :-1]).float(), dim=-1)
        total += (-logp.gather(-1, x[:, 1:, None])[..., 0]).double().sum(0).cpu()
    return total / n


def bands(window: int, band: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """((first, last) token index of the early band, same for the late band), inclusive, within 1..window-1."""
    band = max(1, window // 32) if band is None else band
    k_early = max(1, round(window * EARLY / OLSSON_CONTEXT))
    k_late = min(window - 1, round(window * LATE / OLSSON_CONTEXT))
    early = (max(1, k_early - band), min(window - 1, k_early + band))
    late = (max(1, k_late - band), min(window - 1, k_late + band))
    if early[1] >= late[0]:
        raise EvalError(f"icl: a window of {window} tokens is too short to separate early and late tokens")
    return early, late


def icl_score(
    model,
    tokens,
    window: int | None = None,
    n_windows: int = 64,
    band: int | None = None,
    batch_size: int = 8,
) -> dict[str, Any]:
    """{"icl_score": late-band loss - early-band loss, the two losses, the bands, and the loss curve}."""
    window = window or model.cfg.max_seq_len + 1
    curve = loss_by_position(model, tokens, window, n_windows, batch_size)
    (e0, e1), (l0, l1) = bands(window, band)
    early = float(curve[e0 - 1 : e1].mean())
    late = float(curve[l0 - 1 : l1].mean())
    return {
        "icl_score": late - early,
        "early_loss": early,
        "late_loss": late,
        "early_tokens": [e0, e1],
        "late_tokens": [l0, l1],
        "window": window,
        "windows": min(n_windows, len(tokens) // window),
        "loss_by_position": curve.tolist(),
    }
