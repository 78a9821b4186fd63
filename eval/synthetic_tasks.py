"""Accuracy of models trained on data_pipeline.synthetic tasks, scored only where the task marks.

For a sample (tokens, loss_mask), token t with loss_mask[t] == 1 is predicted from tokens < t.
Reported: token accuracy and loss on the marked positions, exact match (all marked tokens
of a sample right), and the same per sample length (length tracks difficulty, e.g. the
number of key-value pairs). Samples are grouped by length, so batches carry no padding.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from common.constants import DEFAULT_SEED
from common.errors import EvalError
from data_pipeline.progress import progress_bar
from data_pipeline.synthetic import get_task as _get
from data_pipeline.synthetic import list_tasks


def get_task(name: str, task_args: dict | None = None, seed: int = DEFAULT_SEED):
    try:
        return _get(name, seed=seed, **(task_args or {}))
    except ValueError as e:  # DataError: unknown task / bad args
        raise EvalError(f"{e} (available: {list_tasks()})") from e


def trained_task(name: str, info: dict | None):
    """The task `synthetic:<name>` exactly as the checkpoint trained on it (its arguments and seed, from
    the recipe the checkpoint records, read as the loader reads them), or None when it trained on
    something else or records no recipe."""
    data = ((info or {}).get("meta") or {}).get("data") or {}
    if data.get("source") != f"synthetic:{name}":
        return None
    args = dict(data.get("task_args") or {})
    args.pop("n_val", None)
    seed = int(args.pop("seed", data.get("seed", DEFAULT_SEED)))
    return get_task(name, args, seed)


def task_to_score(
    name: str, info: dict | None, task_args: dict | None, task_seed: int | None, other: bool = False
) -> tuple[Any, dict | None]:
    """(the task to score, the trained task's arguments where they differ from it, else None).

    A checkpoint trained on `name` is scored on the task it trained on; `task_args` change some of its
    arguments. Arguments or a seed that differ from the trained ones are refused unless `other` says so: a model trained on 8 pairs and scored on
    16 silently reports a number about another task."""
    trained = trained_task(name, info)
    if trained is None:
        return get_task(name, task_args, DEFAULT_SEED if task_seed is None else task_seed), None
    task = get_task(name, {**trained.args, **(task_args or {})}, trained.seed if task_seed is None else task_seed)
    if (task.args, task.seed) == (trained.args, trained.seed):
        return task, None
    if not other:
        raise EvalError(
            f"synthetic:{name}: the checkpoint trained on task_args {trained.args} (seed {trained.seed}) but "
            f"{task.args} (seed {task.seed}) were given. Fix: drop --task-args/--task-seed to score the "
            "trained task, or add --other-task to score another one on purpose"
        )
    return task, {**trained.args, "seed": trained.seed}


@torch.no_grad()
def evaluate_task(
    model,
    task,
    n: int = 256,
    split: str = "test",
    batch_size: int = 64,
    info: dict | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Token accuracy / loss / exact match of `task` (a data_pipeline task object) on `n` samples."""
    if task.vocab_size > model.cfg.vocab_size:
        raise EvalError(
            f"task {task.tokenizer_id} needs {task.vocab_size} token ids but the checkpoint has "
            f"vocab_size={model.cfg.vocab_size}: the checkpoint was not trained on this task"
        )
    want = (info or {}).get("tokenizer_id")
    if want and want != task.tokenizer_id:
        raise EvalError(f"tokenizer mismatch: checkpoint was trained with {want}, task uses {task.tokenizer_id}")
    device = next(model.parameters()).device
    size = task.size(split)
    n = min(n, size) if size is not None else n
    groups: dict[int, list[tuple[list[int], list[int]]]] = defaultdict(list)
    for i in range(n):
        toks, mask = task.sample(i, split)
        if len(toks) > model.cfg.max_seq_len + 1:
            raise EvalError(
                f"task sample of length {len(toks)} exceeds the model's max_seq_len={model.cfg.max_seq_len}"
            )
        groups[len(toks)].append((toks, mask))
    by_len: dict[str, Counter] = defaultdict(Counter)  # sums of nll, correct, count, exact, samples
    tot: Counter = Counter()
    batches = [
        (L, items[j : j + batch_size]) for L, items in sorted(groups.items()) for j in range(0, len(items), batch_size)
    ]
    for L, items in progress_bar(batches, desc=f"synthetic:{task.name}", unit="batch", enabled=progress, leave=False):
        x = torch.tensor([t for t, _ in items], device=device)
        m = torch.tensor([mk for _, mk in items], device=device, dtype=torch.bool)[:, 1:]
        logp = F.log_softmax(model(x[:, :-1]).float(), dim=-1)
        y = x[:, 1:]
        nll = -logp.gather(-1, y[..., None])[..., 0]
        ok = (logp.argmax(-1) == y) & m
        for acc in (by_len[str(L)], tot):
            acc["nll"] += float(nll[m].double().sum())
            acc["correct"] += int(ok.sum())
            acc["count"] += int(m.sum())
            acc["exact"] += int((ok == m).all(-1).sum())
            acc["samples"] += len(items)
    if tot["count"] == 0:
        raise EvalError(f"task {task.name}: no scored positions in {n} samples")

    def fin(a):
        return {
            "acc": a["correct"] / a["count"],
            "loss": a["nll"] / a["count"],
            "exact_match": a["exact"] / a["samples"],
            "samples": a["samples"],
        }

    return {**fin(tot), "task": task.tokenizer_id, "by_length": {k: fin(v) for k, v in by_len.items()}}
