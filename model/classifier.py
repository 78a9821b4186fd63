"""Sequence classification on top of any variant's backbone (plain PyTorch; docs/CLASSIFICATION.md).

    clf = SequenceClassifier(backbone, num_labels=2, pooling="last", pad_id=0)
    logits = clf(input_ids)                  # (b, num_labels)
    loss = clf(input_ids, labels)            # mean cross-entropy over sequences (labels (b,))

Parameter names are `model.<backbone name>` and `score.*`, so model/freezing.py puts the head in
group "head" and every backbone tensor in its usual group. Padding is on the right; a bidirectional
softmax backbone masks real tokens from the pads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.constants import IGNORE_INDEX
from common.errors import ConfigError

from . import init
from .config import DEFAULT_POOLING, POOLINGS
from .freezing import apply_freeze
from .transformer import Transformer, build_model


class SequenceClassifier(nn.Module):
    def __init__(self, backbone: Transformer, num_labels: int, pooling: str = DEFAULT_POOLING, pad_id: int = 0):
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"classification.pooling must be one of {list(POOLINGS)}, got {pooling!r}")
        if not isinstance(num_labels, int) or num_labels < 2:
            raise ConfigError(f"classification.num_labels must be an integer >= 2, got {num_labels!r}")
        self.model = backbone
        self.cfg = backbone.cfg
        self.num_labels = num_labels
        self.pooling = pooling
        self.pad_id = int(pad_id)
        self.score = nn.Linear(backbone.cfg.hidden_size, num_labels, bias=True)
        with torch.no_grad():
            for name, p in self.score.named_parameters(prefix="score"):
                if not p.is_meta:
                    p.copy_(self.initial_value(name, p.shape))
        self.set_step(0)

    def initial_value(self, name: str, shape) -> torch.Tensor:
        """The backbone's initial values (model/init.py) under `model.`; `score`: N(0, init_std), zero bias."""
        if name.startswith("model."):
            return self.model.initial_value(name.removeprefix("model."), shape)
        if name.endswith("bias"):
            return torch.zeros(tuple(shape), device="cpu")
        return init.normal(shape, self.cfg.init_std, self.model.init_seed, name)

    def set_step(self, step: int) -> list[str]:
        """The backbone's freeze schedule at `step` (group "head" covers `score`); lm_head stays frozen."""
        frozen = apply_freeze(self, self.cfg.frozen_groups_at(step), tied=self.cfg.tie_embeddings)
        if not self.cfg.tie_embeddings:
            self.model.lm_head.weight.requires_grad_(False)
            if "model.lm_head.weight" not in frozen:
                frozen.append("model.lm_head.weight")
        return frozen

    def pool(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        real = input_ids != self.pad_id
        if self.pooling == "mean":
            w = real.to(h.dtype)[..., None]
            return (h * w).sum(1) / w.sum(1).clamp_min(1.0)
        idx = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = torch.where(real, idx, -1).max(dim=1).values.clamp_min(0)  # last non-pad position
        return h[torch.arange(h.shape[0], device=h.device), last]

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Logits (b, num_labels), or the cross-entropy when `labels` (b,) is given: the mean over
        sequences, or their sum with reduction="sum" (IGNORE_INDEX labels are skipped)."""
        doc_ids = None
        pads = input_ids == self.pad_id
        if not self.cfg.causal and self.cfg.mixer == "softmax" and not self.cfg.shaped and bool(pads.any()):
            doc_ids = pads.long()  # real tokens see only real tokens; pads see pads
        h = self.model(input_ids, doc_ids=doc_ids, return_hidden=True)
        logits = self.score(self.pool(self.model.norm(h), input_ids))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction)


def build_classifier(
    cfg,
    num_labels: int,
    pooling: str = DEFAULT_POOLING,
    pad_id: int = 0,
    seed: int | None = None,
    backbone: Transformer | None = None,
) -> SequenceClassifier:
    """A classifier with a fresh backbone from `cfg` (reproducible from `seed`), or around `backbone`."""
    return SequenceClassifier(
        backbone if backbone is not None else build_model(cfg, seed=seed), num_labels, pooling, pad_id
    )
