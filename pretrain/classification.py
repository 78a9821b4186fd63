"""Sequence classification through the pretraining trainer (recipe `task: classification`).

    task: classification
    classification:
      num_labels: 2            # null -> from the data
      pooling: last            # last (last non-pad token) | mean (over non-pad tokens)
      init_from: null          # any checkpoint checkpoint.load_for_eval reads: fine-tune its backbone
    model: {preset: tiny, causal: false}
    data: {source: "classify:data/toy_sentiment.jsonl", tokenizer: bytes}

The model is model.classifier.SequenceClassifier around the variant's backbone; its head is
`score` (freezing group "head"). The loss is the mean cross-entropy over the sequences of the
global batch (each sequence is one scored "token" in the trainer's scaling). With `init_from`,
the backbone's config is the checkpoint's, with the recipe's explicit `model` keys (except
`preset`) applied on top (e.g. causal: false, variant, frozen_groups); the weights must fit.
Pipeline parallelism is refused (the stage split assumes the LM head). The recipe schema is
checked in pretrain/recipe_checks.py; reading a classifier back is checkpoint/consolidate.py's job.
"""
from __future__ import annotations

from pathlib import Path

import torch

from checkpoint import load_for_eval
from data_pipeline.classification import ClassificationLoader, resolve_pad_id
from model import ModelConfig, Transformer
from model.classifier import SequenceClassifier, build_classifier

from .config import REPO_ROOT, RunConfig
from .errors import RecipeError
from .recipe_checks import classification_settings


def _num_labels(cfg: RunConfig) -> int:
    s = classification_settings(cfg)
    if s["num_labels"] is not None:
        return int(s["num_labels"])
    return ClassificationLoader(cfg.data, "train", cfg.train.seq_len, cfg.global_batch_size).num_labels


def _pretrained(path) -> Transformer:
    """The backbone of any checkpoint (a classifier's backbone if it is one)."""
    p = Path(path)
    if not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    model, _ = load_for_eval(p)
    return model.model if isinstance(model, SequenceClassifier) else model


def backbone_config(cfg: RunConfig, vocab_size: int | None) -> ModelConfig | None:
    """With `classification.init_from`: the pretrained backbone's config plus the recipe's explicit
    `model` keys; None without it (the recipe's model section applies as for LM)."""
    s = classification_settings(cfg)
    if not s["init_from"]:
        return None
    base = _pretrained(s["init_from"]).cfg.to_dict()
    explicit = {k: v for k, v in cfg.model.items() if k != "preset"}
    mcfg = ModelConfig.from_dict({**base, **explicit})
    if vocab_size is not None and mcfg.vocab_size < vocab_size:
        raise RecipeError(f"classification.init_from={s['init_from']}: the checkpoint's vocabulary {mcfg.vocab_size} "
                          f"is smaller than the data's {vocab_size}; use the tokenizer it was trained with")
    if mcfg.max_seq_len < cfg.train.seq_len:
        raise RecipeError(f"the backbone's max_seq_len={mcfg.max_seq_len} < train.seq_len={cfg.train.seq_len}")
    return mcfg


def build_classification_model(cfg: RunConfig, mcfg: ModelConfig, seed: int | None) -> SequenceClassifier:
    """A SequenceClassifier: a fresh backbone, or the `init_from` weights loaded into `mcfg`'s backbone."""
    s = classification_settings(cfg)
    backbone = None
    if s["init_from"]:
        pre = _pretrained(s["init_from"])
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            backbone = Transformer(mcfg)
        missing, unexpected = backbone.load_state_dict(pre.state_dict(), strict=False)
        if missing or unexpected:
            raise RecipeError(f"classification.init_from={s['init_from']}: weights do not fit the backbone "
                              f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
        if mcfg.tie_embeddings:
            backbone.lm_head.weight = backbone.embed_tokens.weight
    return build_classifier(mcfg, _num_labels(cfg), s["pooling"], resolve_pad_id(cfg.data), seed=seed,
                            backbone=backbone)
