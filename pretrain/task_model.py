"""The network a recipe trains: its ModelConfig (a preset plus the recipe's `model` keys, the
vocabulary from the data) and the module itself (the LM, or a classifier for `task: classification`)."""
from __future__ import annotations

import torch

from model import ModelConfig, build_model, preset

from . import classification
from .config import RunConfig
from .errors import RecipeError


def model_config(cfg: RunConfig, vocab_size: int | None) -> ModelConfig:
    if cfg.task == "classification":
        mcfg = classification.backbone_config(cfg, vocab_size)
        if mcfg is not None:
            return mcfg
    m = dict(cfg.model)
    name = m.pop("preset", "tiny")
    if m.get("vocab_size") is None:
        if vocab_size is None:
            m.pop("vocab_size", None)
        else:
            m["vocab_size"] = int(vocab_size)
    elif vocab_size is not None and m["vocab_size"] < vocab_size:
        raise RecipeError(f"model.vocab_size={m['vocab_size']} is smaller than the data's vocabulary {vocab_size}")
    m.setdefault("max_seq_len", cfg.train.seq_len)
    if m["max_seq_len"] < cfg.train.seq_len:
        raise RecipeError(f"model.max_seq_len={m['max_seq_len']} < train.seq_len={cfg.train.seq_len}")
    return preset(name, **m)


def build_task_model(cfg: RunConfig, mcfg: ModelConfig, seed: int | None) -> torch.nn.Module:
    """What the trainer trains: the LM (task lm) or a SequenceClassifier (task classification)."""
    if cfg.task == "classification":
        return classification.build_classification_model(cfg, mcfg, seed)
    return build_model(mcfg, seed=seed)
