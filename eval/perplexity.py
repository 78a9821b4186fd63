"""Perplexity over a contiguous token stream with a sliding window (no padding).

Every token after the first is scored exactly once. The first window scores all of its
targets; each later window starts `stride` tokens later and scores only targets not yet
scored, so each scored token sees at least `window - stride` tokens of context
(the standard strided evaluation). Window = tokens per window (the model reads window-1 of them); stride <= window-1. The last window is pulled back to end at the
stream's end, so every window has the same length and batches carry no padding (the same
convention as lm-eval's rolling windows).
Reported token-weighted: loss (nats/token), perplexity, bits per byte (when the byte
count of the scored text is known).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from common.errors import EvalError
from data_pipeline.progress import progress_bar
from data_pipeline.storage import open_shards  # a local directory or an fsspec URL (s3://, https://, ...)
from data_pipeline.text import file_bytes

from . import distributed as D


def window_spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored_token) per window over tokens [0, n); targets are tokens 1..n-1."""
    if n < 2:
        raise EvalError(f"perplexity needs at least 2 tokens, got {n}")
    if window < 2 or not 1 <= stride <= window - 1:
        raise EvalError(
            f"need window >= 2 and 1 <= stride <= window - 1 (consecutive windows share at least the "
            f"one token that predicts the next window's first target); got window={window}, stride={stride}"
        )
    spans, b, scored_to = [], 0, 1
    while True:
        if b + window > n:  # the last window is pulled back to full length: more context, same shape
            b = max(0, n - window)
        e = min(b + window, n)
        spans.append((b, e, max(scored_to, b + 1)))
        scored_to = e
        if e == n:
            return spans
        b += stride


def file_stream(path: str | Path, tokenizer) -> tuple[list[int], int]:
    """Tokens of a text file (EOS first, so every text token is scored) and its UTF-8 byte count."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"text file {p} does not exist")
    if tokenizer is None:
        raise EvalError("perplexity on a text file needs a tokenizer (--tokenizer DIR or --tokenizer bytes)")
    text = file_bytes(p).decode("utf-8")  # a .jsonl file: its texts
    ids = tokenizer.encode(text)
    return [tokenizer.eos_id] + list(ids), len(text.encode("utf-8"))


def shard_stream(
    directory: str | Path, tokenizer=None, max_tokens: int | None = None, expect_tokenizer_id: str | None = None
) -> tuple[np.ndarray, int | None]:
    """Tokens of a prepared (data_pipeline) split; byte count via the tokenizer when given."""
    try:
        shards = open_shards(directory)
    except ValueError as e:
        raise EvalError(str(e)) from e
    tid = shards.manifest.get("tokenizer_id")
    if expect_tokenizer_id and tid and tid != expect_tokenizer_id:
        raise EvalError(
            f"tokenizer mismatch: {directory} was prepared with tokenizer {tid} but the checkpoint "
            f"was trained with {expect_tokenizer_id}. Fix: evaluate on data prepared with the run's tokenizer."
        )
    n = shards.num_tokens if max_tokens is None else min(max_tokens, shards.num_tokens)
    toks = shards.read(0, n)
    return toks, None if tokenizer is None else len(tokenizer.decode(toks[1:].tolist()).encode("utf-8"))


@torch.no_grad()
def _window_batch_nll(
    model, tokens: torch.Tensor, spans: Sequence[tuple[int, int, int]], device
) -> list[tuple[float, int]]:
    """(sum nll in float64, n scored) per window; all spans in the batch have the same length."""
    x = torch.stack([tokens[b:e] for b, e, _ in spans]).to(device)
    logp = F.log_softmax(model(x[:, :-1]).float(), dim=-1)
    nll = -logp.gather(-1, x[:, 1:, None])[..., 0].double().cpu()
    return [(float(row[first - b - 1 :].sum()), e - first) for row, (b, e, first) in zip(nll, spans)]


def perplexity(
    model,
    tokens,
    window: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    n_bytes: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Token-weighted loss / perplexity / bits-per-byte of `tokens` (any int sequence)."""
    device = next(model.parameters()).device
    t = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    if t.numel() and int(t.max()) >= model.cfg.vocab_size:
        raise EvalError(
            f"token id {int(t.max())} is outside the model vocabulary ({model.cfg.vocab_size}); "
            "the tokenizer does not match the checkpoint. Fix: the tokenizer it was trained with (omit --tokenizer)"
        )
    window = min(window or model.cfg.max_seq_len + 1, model.cfg.max_seq_len + 1)  # window-1 inputs fit the model
    stride = stride or window - 1  # default: no recomputation beyond the one shared token
    spans = window_spans(t.numel(), window, stride)
    batches = [spans[i : i + batch_size] for i in range(0, len(spans), batch_size)]  # windows of one length
    mine = D.my_batches(batches)
    done = []
    for i, b in progress_bar(mine, desc="perplexity", unit="batch", enabled=progress and D.is_main(), leave=False):
        done.append((i, _window_batch_nll(model, t, b, device)))
    per_window = [w for batch in D.gather_ordered(done) for w in batch]
    total, count = sum(nll for nll, _ in per_window), sum(n for _, n in per_window)
    return {
        "loss": total / count,
        "perplexity": math.exp(total / count),
        "tokens": count,
        "windows": len(spans),
        "window": window,
        "stride": stride,
        "bits_per_byte": total / math.log(2) / n_bytes if n_bytes else None,
    }
