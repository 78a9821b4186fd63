"""A lab's own generation probe: `exact_match:FILE.jsonl`, a greedy continuation scored by exact match.

FILE.jsonl holds one JSON object per line: ``{"prompt": "12+7=", "answer": "19", "stop": "\\n"}``
(`stop`, a string or a list of strings, is optional). Scoring, the same here and in the lm-eval adapter:

* each prompt is continued greedily for as many tokens as its answer and its longest stop take (plus
  one), ending early at EOS; prompts of equal token length share a batch;
* with `stop`, the prediction is the continuation up to its first stop (or EOS) and must equal the
  answer: the answer has to end there;
* without, the continuation must begin with the answer (its first len(answer) characters are compared).

Reported: `exact_match` (share of records), `char_acc` (per record, the share of answer characters right
at their position, averaged over records), `by_position/<i>` (accuracy of answer character i, 1-based,
over the records that long), `samples`, and up to 20 `errors` (prompt, answer, prediction).
Works with any tokenizer, the byte tokenizer included.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from common.errors import EvalError
from data_pipeline.progress import progress_bar

from . import distributed as D
from .generate import generate

PREFIX = "exact_match:"
MAX_ERRORS = 20


@dataclass(frozen=True)
class Record:
    prompt: str
    answer: str
    stops: tuple[str, ...]
    line: int


def task_file(task: str) -> Path:
    """The file of an `exact_match:FILE` task name."""
    path = task[len(PREFIX) :] if task.startswith(PREFIX) else task
    if not path:
        raise EvalError(
            "task exact_match needs a file: exact_match:FILE.jsonl. Fix: name a JSONL file of "
            '{"prompt": ..., "answer": ...} records after the colon'
        )
    return Path(path)


def result_key(task: str) -> str:
    """Where the results of `exact_match:DIR/NAME.jsonl` go: `exact_match:NAME` (short metric names)."""
    return PREFIX + task_file(task).stem


def read_records(path: str | Path) -> list[Record]:
    """The records of a JSONL file, checked: prompt and answer strings, answer non-empty, stop a string
    or a list of non-empty strings. Errors name FILE:LINE and the fix."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(
            f"exact_match file {p} does not exist. Fix: pass exact_match:FILE.jsonl with one "
            '{"prompt": ..., "answer": ...} object per line'
        )
    out = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise EvalError(f"{p} is not UTF-8 text ({e}). Fix: write the JSONL file as UTF-8") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{p}:{n}: not a JSON object ({e}). Fix: one JSON object per line") from None
        if not isinstance(r, dict) or not isinstance(r.get("prompt"), str) or not isinstance(r.get("answer"), str):
            raise EvalError(
                f'{p}:{n}: expected {{"prompt": string, "answer": string}}, got {line[:80]!r}. '
                "Fix: give every record a prompt and an answer string"
            )
        if not r["answer"]:
            raise EvalError(f"{p}:{n}: empty answer. Fix: give a non-empty answer (or drop the record)")
        stop = r.get("stop")
        stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (tuple, list)) or not all(isinstance(s, str) and s for s in stops):
            raise EvalError(
                f"{p}:{n}: stop must be a non-empty string or a list of them, got {stop!r}. "
                'Fix: e.g. "stop": "\\n", or leave stop out'
            )
        out.append(Record(r["prompt"], r["answer"], tuple(stops), n))
    if not out:
        raise EvalError(f"{p} holds no records. Fix: one JSON object per line with prompt and answer")
    return out


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def prediction(continuation: str, rec: Record) -> str:
    """What is compared with the answer: the continuation cut at the record's first stop, or (no
    stop) its first len(answer) characters. `continuation` is already cut at EOS."""
    if rec.stops:
        return continuation[
            : min((continuation.find(s) for s in rec.stops if s in continuation), default=len(continuation))
        ]
    return continuation[: len(rec.answer)]


def score(pred: str, answer: str) -> tuple[bool, list[bool]]:
    """(exact match, per answer position: the predicted character there is right)."""
    return pred == answer, [i < len(pred) and pred[i] == c for i, c in enumerate(answer)]


def budget(tokenizer, rec: Record) -> int:
    """New tokens to generate: the answer's and the longest stop's tokens, plus one (a token boundary
    inside a prompt can shift by one for subword tokenizers)."""
    return len(tokenizer.encode(rec.answer)) + max((len(tokenizer.encode(s)) for s in rec.stops), default=0) + 1


def continuation_text(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The generated text, cut at EOS; decoded together with the prompt so that subword tokenizers keep
    a leading space (decoding the new ids alone would drop it)."""
    eos = tokenizer.eos_id
    if eos is not None and eos in new_ids:
        new_ids = new_ids[: new_ids.index(eos)]
    head = tokenizer.decode(prompt_ids)
    full = tokenizer.decode(list(prompt_ids) + list(new_ids))
    return full[len(head) :] if full.startswith(head) else tokenizer.decode(new_ids)


def summarize(records: Sequence[Record], preds: Sequence[str], path: str | Path) -> dict[str, Any]:
    exact, char_acc, by_pos, errors = 0, 0.0, {}, []
    for rec, pred in zip(records, preds):
        ok, pos = score(pred, rec.answer)
        exact += ok
        char_acc += sum(pos) / len(pos)
        for i, good in enumerate(pos, 1):
            hit = by_pos.setdefault(str(i), [0, 0])
            hit[0] += good
            hit[1] += 1
        if not ok and len(errors) < MAX_ERRORS:
            errors.append({"line": rec.line, "prompt": rec.prompt, "answer": rec.answer, "prediction": pred})
    n = len(records)
    return {
        "exact_match": exact / n,
        "char_acc": char_acc / n,
        "by_position": {k: h / t for k, (h, t) in by_pos.items()},
        "samples": n,
        "errors": errors,
        "file": str(path),
        "file_sha256": file_digest(path),
    }


@torch.no_grad()
def evaluate_exact_match(
    model, tokenizer, path: str | Path, batch_size: int = 32, progress: bool = True
) -> dict[str, Any]:
    """Greedy continuations of every record of `path`, batched by prompt length, scored (module docstring)."""
    if tokenizer is None:
        raise EvalError("exact_match needs a tokenizer. Fix: pass --tokenizer DIR or --tokenizer bytes")
    records = read_records(path)
    T = model.cfg.max_seq_len
    items = []
    for i, rec in enumerate(records):
        ids = tokenizer.encode(rec.prompt) or [tokenizer.eos_id]
        need = budget(tokenizer, rec)
        if len(ids) + need - 1 > T:
            raise EvalError(
                f"{path}:{rec.line}: the prompt ({len(ids)} tokens) and the answer's budget ({need} "
                f"tokens) do not fit the model's max_seq_len={T}. Fix: shorten the prompt"
            )
        items.append((len(ids), i, ids, need))
    batches: list[list[tuple[int, list[int], int]]] = []  # prompts of one length, at most batch_size each
    for _, group in itertools.groupby(sorted(items), key=lambda item: item[0]):
        same = [item[1:] for item in group]
        batches += [same[j : j + batch_size] for j in range(0, len(same), batch_size)]
    done = []
    bar = progress_bar(total=len(batches), desc="exact_match", enabled=progress and D.is_main())
    for bi, batch in D.my_batches(batches):
        prompts = torch.tensor([ids for _, ids, _ in batch], dtype=torch.long)
        new = generate(model, prompts, max(n for _, _, n in batch), eos_id=tokenizer.eos_id)
        done.append(
            (bi, [(i, continuation_text(tokenizer, ids, row[:need])) for (i, ids, need), row in zip(batch, new)])
        )
        bar.update(1)
    bar.close()
    texts = dict(pair for batch in D.gather_ordered(done) for pair in batch)
    preds = [prediction(texts[i], rec) for i, rec in enumerate(records)]
    return summarize(records, preds, path)
