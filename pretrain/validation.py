"""Periodic validation as a callback: the held-out loss (per set with `data.val_sets`) and the caller's
hooks (pretrain/hooks.py) every `train.eval_every_steps` and at the last step, into that step's record."""

from __future__ import annotations

import math
from typing import Any

from . import loaders
from .callbacks import Callback
from .context import RunContext
from .engine import ModelEngine
from .hooks import TrainHook, run_hooks


class Validation(Callback):
    """Built where `train.eval_every_steps` is set (pretrain/setup.py); every rank evaluates its share."""

    def __init__(self, ctx: RunContext, model_engine: ModelEngine, tokenizer_id: str | None, hooks: list[TrainHook]):
        self.ctx, self.cfg, self.model_engine = ctx, ctx.cfg, model_engine
        self.tokenizer_id, self.hooks = tokenizer_id, hooks
        self.metrics_every = ctx.cfg.train.eval_every_steps
        self._val_sets: dict | None = None  # data.val_sets' loaders, built at the first evaluation

    def step_metrics(self, step: int) -> dict[str, Any]:
        rec = self.evaluate()
        model = self.model_engine.model
        rec.update(run_hooks(self.hooks, model, step, self.model_engine.gathered(model.parameters())))
        return rec

    def evaluate(self) -> dict[str, float]:
        """`val_loss` on the held-out split; with `data.val_sets`, `val_loss/<name>` per set (each read
        from its start, at most `train.eval_batches` batches) and `val_loss` pooled over their tokens."""
        cfg, run_dir = self.cfg, self.ctx.run_dir
        dp_rank, dp = self.model_engine.dp_rank, self.ctx.layout.data_parallel
        if self._val_sets is None:
            self._val_sets = loaders.val_sets(cfg, dp_rank, dp, run_dir, self.tokenizer_id) or {}
        if not self._val_sets:
            val = loaders.loader(cfg, "val", dp_rank, dp, verify_record=run_dir)
            return {"val_loss": self.model_engine.eval_loss(iter(val), cfg.train.eval_batches)}
        out, ce_all, n_all = {"val_loss": math.nan}, 0.0, 0.0
        for name, loader in self._val_sets.items():
            ce, n = self.model_engine.eval_sums(loader.iter_epoch(), cfg.train.eval_batches)
            out[f"val_loss/{name}"] = ce / max(n, 1.0)
            ce_all, n_all = ce_all + ce, n_all + n
        out["val_loss"] = ce_all / max(n_all, 1.0)
        return out
