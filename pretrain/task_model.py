"""The network a recipe trains: its ModelConfig (a preset plus the recipe's `model` keys, the
vocabulary from the data) and the module itself (the LM, or a classifier for `task: classification`)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from common.errors import RecipeError
from model import PRESETS, ModelConfig, preset
from model.transformer import Transformer

from . import classification
from .config import RunConfig


def model_config(cfg: RunConfig, vocab_size: int | None) -> ModelConfig:
    if cfg.task == "classification":
        mcfg = classification.backbone_config(cfg, vocab_size)
        if mcfg is not None:
            return mcfg
    m, name = dict(cfg.model.fields), cfg.model.preset
    # An explicit vocabulary (the recipe's model.vocab_size, else the preset's own, e.g. 1b's
    # 128,256) is kept, so the model trained is the one named (a byte-level `text:` source must
    # not shrink it to 256); `model.vocab_size: null` or a preset without one takes the data's.
    explicit = m.get("vocab_size", PRESETS.get(name, {}).get("vocab_size"))
    if explicit is None:
        if vocab_size is None:
            m.pop("vocab_size", None)
        else:
            m["vocab_size"] = int(vocab_size)
    elif vocab_size is not None and explicit < vocab_size:
        raise RecipeError(
            f"model.vocab_size={explicit} is smaller than the data's vocabulary {vocab_size}. "
            f"Fix: set model.vocab_size to at least {vocab_size}, or model.vocab_size=null to take the data's"
        )
    m.setdefault("max_seq_len", cfg.train.seq_len)
    if m["max_seq_len"] < cfg.train.seq_len:
        raise RecipeError(f"model.max_seq_len={m['max_seq_len']} < train.seq_len={cfg.train.seq_len}")
    return preset(name, **m)


def task_model_builder(
    cfg: RunConfig, mcfg: ModelConfig, seed: int | None
) -> tuple[Callable[[], torch.nn.Module], dict[str, torch.Tensor] | None]:
    """What the trainer trains, the LM (task lm) or a SequenceClassifier (task classification), as
    (construct, start_state). `construct()` reads nothing (call it on the meta device or under
    ZeRO-3's zero.Init); `start_state` holds weights that replace initial values (a classifier's
    pretrained backbone), or is None. Everything that reads files or data happens here, first."""
    if cfg.task == "classification":
        return classification.classification_model_builder(cfg, mcfg, seed)
    return functools.partial(Transformer, mcfg, init_seed=seed), None
