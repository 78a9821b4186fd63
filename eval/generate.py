"""Text generation: greedy (the default), or sampling with a temperature and top-k / top-p, with or
without the incremental cache.

The cache holds keys and values for softmax variants and values only for MixiT (its
mixing weights do not depend on the input, so there are no keys to keep). The cached
path gives the same tokens as recomputing the whole sequence at every step.

CLI (without --tokenizer, the one the checkpoint was trained with):
    python -m eval.generate --checkpoint CKPT [--tokenizer TOK] --prompt "Once upon" \
        --max-new-tokens 50 [--top-k 50] [--top-p 0.9] [--temperature 0.8] [--seed 0] [--no-cache]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

import torch

from common.cli import CliParser, run_cli
from common.errors import EvalError
from model.transformer import new_tokens_that_fit

from .loading import load_checkpoint, missing_tokenizer_error, pick_tokenizer

log = logging.getLogger(__name__)


def is_greedy(top_k: int | None = None, top_p: float | None = None, temperature: float | None = None) -> bool:
    """Greedy unless something asks for sampling (a temperature > 0, top_k or top_p); temperature 0 is greedy."""
    return temperature == 0 or (temperature is None and top_k is None and top_p is None)


def sample_next(
    logits: torch.Tensor,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (b, V) -> next ids (b,). Greedy by default (see is_greedy); sampling uses temperature 1
    unless one is given."""
    if is_greedy(top_k, top_p, temperature):
        return logits.argmax(-1)
    logits = logits.float() / (1.0 if temperature is None else temperature)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, idx = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int = 32,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float | None = None,
    seed: int = 0,
    use_cache: bool = True,
    eos_id: int | None = None,
    return_logits: bool = False,
):
    """Continue `prompt_ids` (1-D, or 2-D for a batch of equal-length prompts), greedily unless a
    temperature > 0, top_k or top_p asks for sampling; returns the new ids (list per row, cut after
    the first `eos_id`) and, with return_logits, the (b, new, V) logits that produced them. Generation
    stops where the model's context is full, with one line that says so (model.transformer.new_tokens_that_fit)."""
    device = next(model.parameters()).device
    x = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    single = x.dim() == 1
    if single:
        x = x[None]
    if x.shape[1] == 0:
        raise EvalError("generate: empty prompt")
    T = model.cfg.max_seq_len
    if x.shape[1] > T:
        raise EvalError(
            f"generate: prompt of {x.shape[1]} tokens exceeds max_seq_len={T}. Fix: a prompt of at most {T} tokens"
        )
    steps, cut = new_tokens_that_fit(T, x.shape[1], max_new_tokens)
    if cut:
        log.warning(cut)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache = model.new_cache() if use_cache else None
    seq, new, all_logits = x, [], []
    done = torch.zeros(x.shape[0], dtype=torch.bool, device=device)
    for step in range(steps):
        if use_cache:
            logits = model(x if step == 0 else new[-1][:, None], cache=cache)[:, -1]
        else:
            logits = model(seq)[:, -1]
        all_logits.append(logits.float())
        nxt = sample_next(logits.cpu(), top_k, top_p, temperature, gen).to(device)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        new.append(nxt)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    ids = torch.stack(new, 1).tolist() if new else [[] for _ in range(x.shape[0])]
    if eos_id is not None:
        ids = [row[: row.index(eos_id) + 1] if eos_id in row else row for row in ids]
    out = ids[0] if single else ids
    if return_logits:
        lg = torch.stack(all_logits, 1)
        return out, (lg[0] if single else lg)
    return out


def _temperature(text: str) -> float:
    t = float(text)
    if t < 0 or t != t:
        raise argparse.ArgumentTypeError(f"{text} is not a temperature >= 0 (0 = greedy)")
    return t


def build_parser() -> argparse.ArgumentParser:
    ap = CliParser(
        prog="python -m eval.generate",
        description="Generate text from a checkpoint. Decoding is greedy (the most likely token at "
        "every step) unless --temperature > 0, --top-k or --top-p asks for sampling.",
    )
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument(
        "--tokenizer",
        help="tokenizer dir, or 'bytes' (default: the one the checkpoint was trained with); omit with --prompt-ids",
    )
    ap.add_argument("--prompt", default="")
    ap.add_argument("--prompt-ids", help="comma-separated token ids (no tokenizer needed)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, help="sample from the k most likely tokens (default: greedy)")
    ap.add_argument("--top-p", type=float, help="sample from the smallest set with probability >= p (default: greedy)")
    ap.add_argument(
        "--temperature",
        type=_temperature,
        help="sampling temperature; default: greedy decoding (0 = greedy; 1 when only --top-k/--top-p is given)",
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--no-cache", action="store_true", help="recompute the full sequence every step")
    ap.add_argument("--device", default="cpu")
    return ap


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise EvalError(
            f"--prompt-ids {text!r} is not a comma-separated list of integers. Fix: e.g. --prompt-ids 5,17,3"
        ) from None


def run(a: argparse.Namespace) -> int:
    model, info = load_checkpoint(a.checkpoint, a.device)
    tok = pick_tokenizer(a.tokenizer, model, info)
    if a.prompt_ids:
        ids = _prompt_ids(a.prompt_ids)
        if not ids or max(ids) >= model.cfg.vocab_size or min(ids) < 0:
            raise EvalError(
                f"--prompt-ids must be ids in [0, {model.cfg.vocab_size}). Fix: pass ids of the checkpoint's vocabulary"
            )
    elif tok is not None:
        ids = tok.encode(a.prompt) or [tok.eos_id]
    else:
        raise missing_tokenizer_error(info, "--prompt")
    sampling = dict(top_k=a.top_k, top_p=a.top_p, temperature=a.temperature, seed=a.seed)
    out = generate(
        model, ids, a.max_new_tokens, **sampling, use_cache=not a.no_cache, eos_id=getattr(tok, "eos_id", None)
    )
    print(a.prompt + tok.decode(out) if tok is not None and not a.prompt_ids else json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
