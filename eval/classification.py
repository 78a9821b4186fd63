"""Eval task `classification`: accuracy and loss of a sequence classifier on held-out data.

The data is the run's own (`data` section of the checkpoint's recipe, validation split) unless
--task-args overrides it, e.g. '{"source": "classify:other.jsonl", "split": "train"}' (any key
of data_pipeline.classification plus `split`, `seq_len`, `limit`). Also reported: the
majority-class rate of that data (the accuracy of always answering the commonest label).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common.errors import EvalError
from data_pipeline.classification import ClassificationLoader
from data_pipeline.config import ClassifyData, parse_data
from model.classifier import SequenceClassifier

EXTRA_KEYS = ("split", "seq_len", "limit")


@torch.no_grad()
def evaluate_classification(
    model, info: dict[str, Any], task_args: dict | None = None, batch_size: int = 64, device=None
) -> dict[str, Any]:
    if not isinstance(model, SequenceClassifier):
        raise EvalError(
            f"task classification needs a classification checkpoint (recipe task: classification); "
            f"{info.get('path')} is a language model"
        )
    meta = info.get("meta", {})
    args = dict(task_args or {})
    extra = {k: args.pop(k) for k in EXTRA_KEYS if k in args}
    known = {f.name for f in dataclasses.fields(ClassifyData)}
    data = {**{k: v for k, v in (meta.get("data") or {}).items() if k in known}, **args}
    if not data.get("source"):
        raise EvalError(
            "task classification: no data (the checkpoint records none). Fix: pass --task-args "
            '\'{"source": "classify:FILE.jsonl"}\''
        )
    seq_len = int(extra.get("seq_len") or meta.get("seq_len") or model.cfg.max_seq_len)
    try:
        loader = ClassificationLoader(parse_data(data), extra.get("split", "val"), seq_len, 1)
    except ValueError as e:
        raise EvalError(f"task classification: {e}") from e
    if loader.num_labels > model.num_labels:
        raise EvalError(f"the data has {loader.num_labels} labels but the classifier has {model.num_labels}")
    n = min(loader.n, int(extra["limit"])) if extra.get("limit") else loader.n
    device = device or next(model.parameters()).device
    model.eval()
    nll, correct = 0.0, 0
    for i in range(0, n, batch_size):
        x = torch.from_numpy(loader.input_ids[i : min(n, i + batch_size)]).to(device)
        y = torch.from_numpy(loader.labels[i : min(n, i + batch_size)]).to(device)
        logits = model(x).float()
        nll += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
    return {
        "acc": correct / n,
        "loss": nll / n,
        "samples": n,
        "majority_acc": float(np.bincount(loader.labels[:n], minlength=loader.num_labels).max() / n),
        "split": loader.split,
        "source": loader.source,
    }
