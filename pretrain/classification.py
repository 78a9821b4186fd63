"""Sequence classification through the pretraining trainer (recipe `task: classification`;
docs/CLASSIFICATION.md).

    task: classification
    classification:
      num_labels: 2            # null -> from the data
      pooling: last            # last (last non-pad token) | mean (over non-pad tokens)
      init_from: null          # any checkpoint checkpoint.load_for_eval reads: fine-tune its backbone
    model: {preset: tiny, causal: false}
    data: {source: "classify:data/toy_sentiment.jsonl", tokenizer: bytes}

The recipe schema is checked in pretrain/recipe_checks.py; reading a classifier back is
checkpoint/consolidate.py's job.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from checkpoint import load_for_eval
from common.constants import repo_path
from common.errors import RecipeError
from data_pipeline.classification import resolve_pad_id
from model import ModelConfig
from model.classifier import SequenceClassifier, build_classifier
from model.transformer import Transformer

from . import loaders
from .config import RunConfig
from .recipe_checks import classification_settings


def _pretrained(path) -> Transformer:
    """The backbone of any checkpoint (a classifier's backbone if it is one)."""
    model, _ = load_for_eval(repo_path(path))
    return model.model if isinstance(model, SequenceClassifier) else model


def backbone_config(cfg: RunConfig, vocab_size: int | None) -> ModelConfig | None:
    """With `classification.init_from`: the pretrained backbone's config plus the recipe's explicit
    `model` keys; None without it (the recipe's model section applies as for LM)."""
    s = classification_settings(cfg)
    if not s["init_from"]:
        return None
    base = _pretrained(s["init_from"]).cfg.to_dict()
    mcfg = ModelConfig.from_dict({**base, **cfg.model.fields})
    if vocab_size is not None and mcfg.vocab_size < vocab_size:
        raise RecipeError(
            f"classification.init_from={s['init_from']}: the checkpoint's vocabulary {mcfg.vocab_size} "
            f"is smaller than the data's {vocab_size}. Fix: use the tokenizer it was trained with"
        )
    if mcfg.max_seq_len < cfg.train.seq_len:
        raise RecipeError(f"the backbone's max_seq_len={mcfg.max_seq_len} < train.seq_len={cfg.train.seq_len}")
    return mcfg


def classification_model_builder(
    cfg: RunConfig, mcfg: ModelConfig, seed: int | None
) -> tuple[Callable[[], SequenceClassifier], dict[str, torch.Tensor] | None]:
    """(construct, start_state) of a SequenceClassifier (pretrain/task_model.py): a fresh backbone, or
    the `init_from` weights as the start state of `mcfg`'s backbone (checked to fit, by name and shape)."""
    s = classification_settings(cfg)
    num_labels = loaders.loader(cfg, "train").num_labels if s["num_labels"] is None else int(s["num_labels"])
    pad_id = resolve_pad_id(cfg.data)
    construct = functools.partial(build_classifier, mcfg, num_labels, s["pooling"], pad_id, seed=seed)
    if not s["init_from"]:
        return construct, None
    pre = _pretrained(s["init_from"]).state_dict()
    with torch.device("meta"):
        want = {k: v.shape for k, v in Transformer(mcfg, init_seed=0).state_dict().items()}
    missing, unexpected = sorted(want.keys() - pre.keys()), sorted(pre.keys() - want.keys())
    misfit = sorted(k for k in want.keys() & pre.keys() if pre[k].shape != want[k])
    if missing or unexpected or misfit:
        raise RecipeError(
            f"classification.init_from={s['init_from']}: weights do not fit the backbone "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}, other shape {misfit[:3]})"
        )
    return construct, {f"model.{k}": v for k, v in pre.items()}
