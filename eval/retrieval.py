"""In-context retrieval probes for pretrained LMs; each reports a score per length (and depth).

- induction: a random-token sequence shown twice; accuracy/loss of predicting the repeat
  (first-half loss reported alongside as the no-copy baseline). Pure tokens, no tokenizer.
- kv_recall: `k1 v1 k2 v2 ... kn vn k_q` -> v_q with random token ids. Pure tokens.
- passkey: a number hidden in filler text at several lengths and depths, then
  "What is the pass key? The pass key is"; exact match of the teacher-forced greedy
  answer tokens. Needs a tokenizer.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from common.errors import EvalError
from data_pipeline.progress import progress_bar


def _rng(seed: int, *key) -> random.Random:
    return random.Random("-".join(str(k) for k in (seed,) + tuple(key)))  # str seeds are hashed deterministically


@torch.no_grad()
def _score(
    model, seqs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], device, batch_size: int = 16
) -> list[tuple[float, int, int]]:
    """For each sequence and its list of target positions p (token p predicted from tokens < p):
    (sum nll, n correct argmax, n targets). Sequences in one call must have equal length."""
    out = []
    for i in range(0, len(seqs), batch_size):
        x = torch.tensor([list(s) for s in seqs[i : i + batch_size]], dtype=torch.long, device=device)
        logp = F.log_softmax(model(x[:, :-1]).float(), dim=-1)
        for row, tg, s in zip(logp, targets[i : i + batch_size], x):
            pos = torch.tensor(tg, device=device) - 1
            true = s[pos + 1]
            nll = -row[pos].gather(-1, true[:, None])[:, 0]
            correct = (row[pos].argmax(-1) == true).sum()
            out.append((float(nll.double().sum()), int(correct), len(tg)))
    return out


def _summ(scores: list[tuple[float, int, int]]) -> dict[str, float]:
    n = sum(s[2] for s in scores)
    return {"acc": sum(s[1] for s in scores) / n, "loss": sum(s[0] for s in scores) / n}


def _exact(scores: list[tuple[float, int, int]]) -> dict[str, float]:
    """Share of answers right in every token, and the loss per answer token."""
    return {
        "acc": sum(c == k for _, c, k in scores) / len(scores),
        "loss": sum(s[0] for s in scores) / sum(s[2] for s in scores),
    }


def _repeat_scores(model, halves: Sequence[Sequence[int]], device, batch_size: int):
    """Each half shown twice: the scores of the repeat (tokens L+1..2L-1, predictable from the first
    occurrence) and of the same tokens the first time (1..L-1)."""
    L = len(halves[0])
    seqs = [list(h) + list(h) for h in halves]
    rep = _score(model, seqs, [list(range(L + 1, 2 * L))] * len(seqs), device, batch_size)
    return rep, _score(model, seqs, [list(range(1, L))] * len(seqs), device, batch_size)


def _token_range(model, tokenizer, low: int | None, high: int | None = None) -> tuple[int, int]:
    hi = model.cfg.vocab_size if tokenizer is None else min(tokenizer.vocab_size, model.cfg.vocab_size)
    if high is not None:
        hi = min(hi, high)
    lo = low if low is not None else 0
    if tokenizer is not None and low is None:
        lo = max(0, min(4, hi - 2))  # skip the usual special ids (unk/bos/eos/pad)
    return lo, hi


def induction(
    model,
    lengths: Sequence[int] = (16, 32, 64),
    n: int = 32,
    seed: int = 0,
    tokenizer=None,
    batch_size: int = 16,
    progress: bool = True,
    token_low: int | None = None,
    token_high: int | None = None,
) -> dict[str, Any]:
    """Repeated random tokens [x_1..x_L, x_1..x_L] (ids in [token_low, token_high)): accuracy and loss
    on the repeat, per L."""
    device = next(model.parameters()).device
    lo, hi = _token_range(model, tokenizer, token_low, token_high)
    by_len: dict[str, Any] = {}
    all_rep, all_first = [], []
    for L in progress_bar(lengths, desc="induction", unit="length", enabled=progress, leave=False):
        if 2 * L > model.cfg.max_seq_len:
            continue
        r = _rng(seed, "induction", L)
        halves = [[r.randrange(lo, hi) for _ in range(L)] for _ in range(n)]
        rep, first = _repeat_scores(model, halves, device, batch_size)
        by_len[str(L)] = {**_summ(rep), "first_half_loss": _summ(first)["loss"]}
        all_rep += rep
        all_first += first
    if not by_len:
        raise EvalError(
            f"induction: every length in {list(lengths)} is too long for max_seq_len={model.cfg.max_seq_len}"
        )
    return {
        **_summ(all_rep),
        "first_half_loss": _summ(all_first)["loss"],
        "chance_acc": 1.0 / (hi - lo),
        "by_length": by_len,
    }


def repeated(model, halves: Sequence[Sequence[int]], batch_size: int = 16) -> dict[str, float]:
    """The caller's sequences (e.g. chunks of held-out text), each shown twice: accuracy and loss on the
    repeat and on the same tokens the first time (`_repeat_scores`)."""
    device = next(model.parameters()).device
    L = len(halves[0]) if halves else 0
    if not halves or any(len(h) != L for h in halves) or 2 * L > model.cfg.max_seq_len + 1:
        raise EvalError(f"repeated: need equal-length halves with 2L <= max_seq_len + 1 ({model.cfg.max_seq_len + 1})")
    rep, first = (_summ(s) for s in _repeat_scores(model, halves, device, batch_size))
    return {"acc": rep["acc"], "loss": rep["loss"], "first_half_loss": first["loss"], "first_half_acc": first["acc"]}


def kv_recall(
    model,
    num_pairs: Sequence[int] = (2, 4, 8),
    n: int = 64,
    seed: int = 0,
    tokenizer=None,
    batch_size: int = 16,
    progress: bool = True,
    token_low: int | None = None,
) -> dict[str, Any]:
    """`k1 v1 ... kn vn kq` -> vq with distinct random key ids; accuracy/loss of vq, per number of pairs."""
    device = next(model.parameters()).device
    lo, hi = _token_range(model, tokenizer, token_low)
    by_n: dict[str, Any] = {}
    scores_all = []
    for P in progress_bar(num_pairs, desc="kv_recall", unit="size", enabled=progress, leave=False):
        if 2 * P + 2 > model.cfg.max_seq_len + 1 or P > hi - lo:
            continue
        r = _rng(seed, "kv", P)
        seqs = []
        for _ in range(n):
            keys = r.sample(range(lo, hi), P)
            vals = [r.randrange(lo, hi) for _ in range(P)]
            q = r.randrange(P)
            seqs.append([t for kv in zip(keys, vals) for t in kv] + [keys[q], vals[q]])
        sc = _score(model, seqs, [[2 * P + 1]] * n, device, batch_size)
        by_n[str(P)] = _summ(sc)
        scores_all += sc
    if not by_n:
        raise EvalError(f"kv_recall: no pair count in {list(num_pairs)} fits max_seq_len={model.cfg.max_seq_len}")
    return {**_summ(scores_all), "chance_acc": 1.0 / (hi - lo), "by_num_pairs": by_n}


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = " What is the pass key? The pass key is"


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): filler trimmed so prompt+answer is about `length` tokens, needle at `depth`."""
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.encode(QUESTION)
    answer = tokenizer.encode(f" {key}")
    budget = length - len(needle) - len(question) - len(answer)
    if budget < 0:
        raise EvalError(f"passkey: length {length} is too short for the needle and question")
    filler_unit = tokenizer.encode(FILLER)
    filler = (filler_unit * (budget // max(1, len(filler_unit)) + 1))[:budget]
    cut = int(round(depth * budget))
    return filler[:cut] + needle + filler[cut:] + question, answer


def passkey(
    model,
    tokenizer,
    lengths: Sequence[int] = (64, 128, 256),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    n: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Exact-match retrieval of a 5-digit pass key, per length and depth."""
    if tokenizer is None:
        raise EvalError("passkey is a text probe and needs a tokenizer (--tokenizer DIR, or --tokenizer bytes)")
    device = next(model.parameters()).device
    grid: dict[str, Any] = {}
    scores_all = []
    T = model.cfg.max_seq_len
    for L in progress_bar(lengths, desc="passkey", unit="length", enabled=progress, leave=False):
        if L > T + 1:
            continue
        r = _rng(seed, "passkey", L)
        for d in depths:
            scores = []
            for _ in range(n):
                prompt, ans = passkey_prompt(tokenizer, L, d, r.randrange(10000, 100000))
                scores += _score(model, [prompt + ans], [list(range(len(prompt), len(prompt) + len(ans)))], device)
            grid.setdefault(str(L), {})[f"{d:g}"] = _exact(scores)
            scores_all += scores
    if not grid:
        raise EvalError(f"passkey: every length in {list(lengths)} exceeds max_seq_len={T}")
    return {**_exact(scores_all), "by_length_depth": grid}
