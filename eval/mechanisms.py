"""Mechanism probes: per-head induction and previous-token scores, and MixiT's fixed read map.

On a random-token sequence shown twice ([x_1..x_L, x_1..x_L]) with attention map P
(row i = how much position i reads from each position j):
- previous-token score of a head: mean_i P[i, i-1] over i >= 1
- induction score: mean over the repeat (i >= L) of P[i, i-L+1], i.e. attention to the
  token that followed the previous occurrence of the current token.
Softmax variants use the recorded attention probabilities; MixiT uses its fixed mixing
matrices A (the same "what does position i read" map, input-independent; entries can be
negative, so |A| is also reported). Heatmaps go to a PNG.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from common.errors import EvalError

from .report import new_figure, save_figure


def _scores(P: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """P: (..., t, t) with t = 2L -> (prev_token, induction) of shape (...)."""
    t = P.shape[-1]
    i = torch.arange(1, t)
    prev = P[..., i, i - 1].mean(-1)
    j = torch.arange(L, t)
    ind = P[..., j, j - L + 1].mean(-1)
    return prev, ind


@torch.no_grad()
def attention_maps(
    model,
    L: int = 32,
    n: int = 8,
    seed: int = 0,
    token_range: tuple[int, int] | None = None,
    halves: list[list[int]] | None = None,
) -> tuple[torch.Tensor, bool]:
    """Mean map per layer and head, (layers, H, 2L, 2L); second value True if from MixiT matrices.
    Tokens are drawn from `token_range` [lo, hi) (default: the whole vocabulary); a text model
    is better probed with tokens it has seen (e.g. printable bytes, (32, 127)), or with `halves`:
    the caller's own first halves (n sequences of L tokens, e.g. held-out text), each shown twice."""
    device = next(model.parameters()).device
    t = 2 * L
    if t > model.cfg.max_seq_len:
        raise EvalError(f"mechanisms: 2*L={t} exceeds max_seq_len={model.cfg.max_seq_len}")
    if model.cfg.mixer == "mixit":
        return torch.stack([b.self_attn.matrix(t, device).float().cpu() for b in model.layers]), True
    if halves is not None:
        if not halves or any(len(h) != L for h in halves):
            raise EvalError(f"mechanisms: halves must be a non-empty list of sequences of L={L} tokens")
    else:
        lo, hi = token_range or (0, model.cfg.vocab_size)
        if not 0 <= lo < hi <= model.cfg.vocab_size:
            raise EvalError(
                f"mechanisms: token_range {token_range} is not within [0, vocab_size={model.cfg.vocab_size})"
            )
        r = random.Random(f"mech-{seed}-{L}")
        halves = [[r.randrange(lo, hi) for _ in range(L)] for _ in range(n)]
    x = torch.tensor([list(h) + list(h) for h in halves], device=device)
    for b in model.layers:
        b.self_attn.record_attn = True
    try:
        model(x)
        maps = torch.stack([b.self_attn.last_attn.float().mean(0).cpu() for b in model.layers])
    finally:
        for b in model.layers:
            b.self_attn.record_attn = False
            b.self_attn.last_attn = None
    return maps, False


def mechanism_scores(
    model,
    L: int = 32,
    n: int = 8,
    seed: int = 0,
    heatmap: str | Path | None = None,
    token_range: tuple[int, int] | None = None,
    halves: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Per-head scores as nested lists [layer][head]; the max over heads as headline numbers.
    `halves` (the caller's first halves, e.g. held-out text) replaces the random tokens."""
    L = len(halves[0]) if halves else min(L, model.cfg.max_seq_len // 2)
    maps, fixed = attention_maps(model, L, n, seed, token_range, halves)
    prev, ind = _scores(maps, L)
    out: dict[str, Any] = {
        "source": "mixing_matrix" if fixed else "attention",
        "previous_token_score": prev.tolist(),
        "induction_score": ind.tolist(),
        "max_previous_token_score": float(prev.max()),
        "max_induction_score": float(ind.max()),
    }
    if fixed:
        aprev, aind = _scores(maps.abs(), L)
        out["abs_previous_token_score"] = aprev.tolist()
        out["abs_induction_score"] = aind.tolist()
    if heatmap is not None:
        save_heatmap(maps, prev, ind, heatmap, title=f"{model.cfg.variant} ({out['source']}, L={L})")
        out["heatmap"] = str(heatmap)
    return out


def save_heatmap(maps: torch.Tensor, prev: torch.Tensor, ind: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """Row 0: per-head score grids; below: each layer's read maps, one panel per head."""
    layers, heads = maps.shape[:2]
    fig, axes = new_figure(layers + 1, max(heads, 2), figsize=(2.2 * max(heads, 2), 2.2 * (layers + 1)), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for k, (name, s) in enumerate((("previous-token", prev), ("induction", ind))):
        ax = axes[0][k]
        ax.axis("on")
        im = ax.imshow(s.numpy(), cmap="viridis", aspect="auto")
        ax.set_title(f"{name} score", fontsize=8)
        ax.set_xlabel("head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        fig.colorbar(im, ax=ax)
    for layer in range(layers):
        for h in range(heads):
            ax = axes[layer + 1][h]
            ax.axis("on")
            ax.imshow(maps[layer, h].numpy(), cmap="magma" if maps.min() >= 0 else "RdBu_r", aspect="auto")
            ax.set_title(f"L{layer} H{h}", fontsize=7)
            ax.set(xticks=[], yticks=[])
    fig.suptitle(title + "  (row i reads column j)", fontsize=9)
    return save_figure(fig, path, dpi=80)
