"""Sequence classification through the pretraining trainer (recipe `task: classification`).

    task: classification
    classification:
      num_labels: 2            # null -> from the data
      pooling: last            # last (last non-pad token) | mean (over non-pad tokens)
      init_from: null          # any checkpoint pretrain.export.load_for_eval reads: fine-tune its backbone
    model: {preset: tiny, causal: false}
    data: {source: "classify:data/toy_sentiment.jsonl", tokenizer: bytes}

The model is model.classifier.SequenceClassifier around the variant's backbone; its head is
`score` (freezing group "head"). The loss is the mean cross-entropy over the sequences of the
global batch (each sequence is one scored "token" in the trainer's scaling). With `init_from`,
the backbone's config is the checkpoint's, with the recipe's explicit `model` keys (except
`preset`) applied on top (e.g. causal: false, variant, frozen_groups); the weights must fit.
Pipeline parallelism is refused (the stage split assumes the LM head).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import RecipeError

TASKS = ("lm", "classification")
DEFAULTS: dict[str, Any] = {"num_labels": None, "pooling": "last", "init_from": None}


def settings(cfg) -> dict[str, Any]:
    return {**DEFAULTS, **(cfg.classification or {})}


def validate(cfg) -> None:
    """Recipe checks for `task` / `classification` (called from RunConfig.validate)."""
    if cfg.task not in TASKS:
        raise RecipeError(f"task must be one of {list(TASKS)}, got {cfg.task!r}")
    source = str((cfg.data or {}).get("source", ""))
    if cfg.task == "lm":
        if cfg.classification:
            raise RecipeError("classification: given but task is 'lm'. Fix: set task: classification, or drop the section")
        if source.startswith("classify:"):
            raise RecipeError(f"data.source={source!r} is classification data but task is 'lm'. Fix: task: classification")
        return
    unknown = set(cfg.classification or {}) - set(DEFAULTS)
    if unknown:
        raise RecipeError(f"classification: unknown keys {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    s = settings(cfg)
    from model.classifier import POOLINGS
    if s["pooling"] not in POOLINGS:
        raise RecipeError(f"classification.pooling must be one of {list(POOLINGS)}, got {s['pooling']!r}")
    n = s["num_labels"]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
        raise RecipeError(f"classification.num_labels must be an integer >= 2 (or null: from the data), got {n!r}")
    if not source.startswith("classify:"):
        raise RecipeError(f"task: classification needs data.source='classify:<file.jsonl|file.csv|hf:NAME>', got "
                          f"{source!r}")
    if cfg.parallel.pipeline_stages > 1:
        raise RecipeError("task: classification does not support pipeline parallelism (parallel.pipeline_stages="
                          f"{cfg.parallel.pipeline_stages}). Fix: parallel.pipeline_stages=1 with ZeRO (zero1..zero3)")


def _num_labels(cfg) -> int:
    s = settings(cfg)
    if s["num_labels"] is not None:
        return int(s["num_labels"])
    from data_pipeline.classification import ClassificationLoader
    return ClassificationLoader(cfg.data, "train", cfg.train.seq_len, cfg.global_batch_size).num_labels


def _pretrained(path):
    from .export import load_for_eval
    p = Path(path)
    from .config import REPO_ROOT
    if not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    model, meta = load_for_eval(p)
    from model.classifier import SequenceClassifier
    if isinstance(model, SequenceClassifier):
        model = model.model
    return model, meta


def model_config(cfg, vocab_size: int | None):
    """The backbone's ModelConfig: the recipe's (as for LM), or the pretrained one plus recipe keys."""
    s = settings(cfg)
    if not s["init_from"]:
        return None
    model, _ = _pretrained(s["init_from"])
    base = model.cfg.to_dict()
    explicit = {k: v for k, v in cfg.model.items() if k != "preset"}
    from model import ModelConfig
    mcfg = ModelConfig.from_dict({**base, **explicit})
    if vocab_size is not None and mcfg.vocab_size < vocab_size:
        raise RecipeError(f"classification.init_from={s['init_from']}: the checkpoint's vocabulary {mcfg.vocab_size} "
                          f"is smaller than the data's {vocab_size}; use the tokenizer it was trained with")
    if mcfg.max_seq_len < cfg.train.seq_len:
        raise RecipeError(f"the backbone's max_seq_len={mcfg.max_seq_len} < train.seq_len={cfg.train.seq_len}")
    return mcfg


def build_task_model(cfg, mcfg, seed: int | None):
    """What the trainer trains: the LM (task lm) or a SequenceClassifier (task classification)."""
    from model import build_model
    if getattr(cfg, "task", "lm") != "classification":
        return build_model(mcfg, seed=seed)
    from data_pipeline.classification import resolve_pad_id
    from model.classifier import build_classifier
    s = settings(cfg)
    backbone = None
    if s["init_from"]:
        pre, _ = _pretrained(s["init_from"])
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            from model import Transformer
            backbone = Transformer(mcfg)
        missing, unexpected = backbone.load_state_dict(pre.state_dict(), strict=False)
        if missing or unexpected:
            raise RecipeError(f"classification.init_from={s['init_from']}: weights do not fit the backbone "
                              f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
        if mcfg.tie_embeddings:
            backbone.lm_head.weight = backbone.embed_tokens.weight
    return build_classifier(mcfg, _num_labels(cfg), s["pooling"], resolve_pad_id(cfg.data), seed=seed,
                            backbone=backbone)


def classifier_from_checkpoint(tag_dir, device="cpu"):
    """(SequenceClassifier, meta) from a trainer checkpoint of a classification run."""
    from model.classifier import SequenceClassifier
    from model import Transformer
    from .export import consolidated_state_dict
    mcfg, sd, state = consolidated_state_dict(tag_dir)
    recipe = state.get("recipe", {})
    s = {**DEFAULTS, **(recipe.get("classification") or {})}
    data = recipe.get("data", {})
    num_labels = int(sd["score.weight"].shape[0])
    from data_pipeline.classification import resolve_pad_id
    model = SequenceClassifier(Transformer(mcfg), num_labels, s["pooling"], resolve_pad_id(data))
    full = dict(sd)
    if mcfg.tie_embeddings:
        full["model.lm_head.weight"] = full["model.embed_tokens.weight"]
    missing = set(model.state_dict()) - set(full)
    if missing:
        raise RuntimeError(f"checkpoint {tag_dir} lacks tensors {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.data = full[name].clone()
    if mcfg.tie_embeddings:
        model.model.lm_head.weight = model.model.embed_tokens.weight
    model.set_step(int(state.get("step", 0)))
    meta = {"step": state.get("step"), "tokens_seen": state.get("tokens_seen"),
            "tokenizer_id": state.get("tokenizer_id"), "variant": mcfg.variant, "source": str(tag_dir),
            "task": "classification", "data": data, "seq_len": recipe.get("train", {}).get("seq_len")}
    return model.to(device), meta


def is_classification_state(state: dict[str, Any]) -> bool:
    return state.get("recipe", {}).get("task") == "classification"
