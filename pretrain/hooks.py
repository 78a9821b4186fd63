"""Training hooks: a caller's own probes, run at the validation cadence and logged with the run.

    train(recipe, overrides, hooks=[probe])      # probe(model, step) -> {"name": number, ...}

A hook is called every `train.eval_every_steps` (and at the last step), after validation, on every
rank (it may use collectives), with the plain model in eval mode under `torch.no_grad()`, its full
weights gathered under ZeRO-3. Rank 0 logs what it returns with that step's record: numbers to
metrics.jsonl and TensorBoard, other JSON values (per-head lists) to metrics.jsonl only. Pipeline
parallelism splits the model across ranks, so hooks are refused there.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from common.errors import RecipeError

TrainHook = Callable[[torch.nn.Module, int], dict]
# Keys the loop writes itself; a hook may not overwrite them.
RESERVED = frozenset(
    {"step", "loss", "lr", "tokens_seen", "val_loss", "grad_norm", "tokens_per_s", "step_time_s", "tflops", "mfu"}
)


def check_hooks(hooks: Sequence[TrainHook] | None, eval_every_steps: int, pipeline_stages: int) -> list[TrainHook]:
    """The hooks as a list, refused before any work where they could never run."""
    hooks = list(hooks or [])
    if not hooks:
        return hooks
    if not all(callable(h) for h in hooks):
        raise RecipeError("train(hooks=...): every hook must be a callable (model, step) -> dict")
    if not eval_every_steps:
        raise RecipeError(
            "training hooks run at the validation cadence, but train.eval_every_steps is 0. "
            "Fix: set train.eval_every_steps to how often the hooks should run"
        )
    if pipeline_stages > 1:
        raise RecipeError(
            f"training hooks need the whole model on every rank, but parallel.pipeline_stages="
            f"{pipeline_stages} splits it. Fix: run the hooks' probes after training "
            "(python -m eval.run --run-dir RUN), or train without pipeline parallelism"
        )
    return hooks


def run_hooks(hooks: Sequence[TrainHook], model: torch.nn.Module, step: int, gathered) -> dict[str, Any]:
    """Call every hook on `model` (eval mode, no grad, inside the `gathered` context); merged results."""
    out: dict[str, Any] = {}
    if not hooks:
        return out
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), gathered:
            for hook in hooks:
                got = hook(model, step) or {}
                if not isinstance(got, dict):
                    raise TypeError(f"training hook {hook!r} returned {type(got).__name__}, not a dict of metrics")
                clash = (set(got) & RESERVED) | (set(got) & set(out))
                if clash:
                    raise RecipeError(
                        f"training hook {hook!r} returned metric names {sorted(clash)} that another "
                        "hook or the loop already logs. Fix: give them their own names (e.g. 'probe/...')"
                    )
                out.update(got)
    finally:
        model.train(was_training)
    return out
