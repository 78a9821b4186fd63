"""Training hooks (pretrain/hooks.py): called at the validation cadence with the plain model in eval
mode and no grad, their metrics logged to metrics.jsonl and TensorBoard; refused where they cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.errors import RecipeError
from pretrain.train import train

RECIPE = "recipes/tiny_cpu.yaml"


def test_hooks_run_at_eval_steps_and_are_logged(tmp_path):
    calls, models = [], []

    def probe(model, step):
        calls.append((step, model.training, torch.is_grad_enabled(), type(model).__name__))
        models.append(model)
        # a real function of the weights: the embedding norm the loop should log unchanged
        return {"probe/embed_norm": float(model.embed_tokens.weight.norm()), "probe/per_head": [step, step + 1]}

    res = train(
        RECIPE,
        ["train.max_steps=5", "train.eval_every_steps=2", "checkpoint.every_steps=0", "logging.tensorboard=true"],
        run_dir=tmp_path / "run",
        resume="never",
        hooks=[probe],
    )
    assert [c[0] for c in calls] == [2, 4, 5]  # every eval_every_steps, and the last step
    assert all(c[1:] == (False, False, "Transformer") for c in calls)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    for s in (2, 4, 5):
        assert rows[s]["probe/per_head"] == [s, s + 1] and rows[s]["probe/embed_norm"] > 0
    assert "probe/embed_norm" not in rows[1] and "probe/embed_norm" not in rows[3]
    # the logged norm is the model's at that step: the weights moved between evaluations
    assert rows[2]["probe/embed_norm"] != rows[4]["probe/embed_norm"]
    assert res.final_step == 5
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("probe/embed_norm")] == [2, 4, 5]
    assert models[0] is models[-1] and models[-1].training  # the same model, back in training mode after


def test_hooks_are_refused_before_work_where_they_cannot_run(tmp_path):
    with pytest.raises(RecipeError, match="eval_every_steps"):
        train(RECIPE, ["train.eval_every_steps=0"], run_dir=tmp_path / "a", resume="never", hooks=[lambda m, s: {}])
    with pytest.raises(RecipeError, match="callable"):
        train(RECIPE, [], run_dir=tmp_path / "b", resume="never", hooks=["not a function"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_hook_may_not_overwrite_the_loops_metrics(tmp_path):
    with pytest.raises(ValueError, match="loss"):
        train(
            RECIPE,
            ["train.max_steps=2", "train.eval_every_steps=2", "logging.tensorboard=false"],
            run_dir=tmp_path / "run",
            resume="never",
            hooks=[lambda m, s: {"loss": 0.0}],
        )
