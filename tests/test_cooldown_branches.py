"""Cooldown branches: one stable-phase run, and from two of its checkpoints a short wsd decay into
new run dirs. A branch resumes like any run (weights, optimizer, data position), so its first loss
is the stable run's at that step; its rate follows the 1-sqrt decay to min_lr; the stable run's
directory is not touched. A branch keeps the rate of every step trained, so it needs no permission;
a resume that changes one (a re-stretched cosine) is refused in one line unless allowed, and an allowed
one logs the rate before and after."""

from __future__ import annotations

import hashlib
import json

import pytest
from conftest import read_losses

from common.errors import RecipeError
from pretrain.config import load_recipe
from pretrain.loop import lr_at
from pretrain.train import train
from studies.scaling.ladder import branch_overrides

RECIPE = "recipes/tiny_cpu.yaml"
BASE = [
    "model.variant=standard",
    "train.eval_every_steps=0",
    "logging.tensorboard=false",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
]


def tree_digest(root):
    """Every file under root with its content hash: any write shows."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_branches_resume_the_stable_run_and_decay(tmp_path, capsys):
    stable = tmp_path / "stable"
    stable_over = [
        *BASE,
        "optim.decay=constant",
        "train.max_steps=12",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=0",
    ]
    train(RECIPE, stable_over, run_dir=stable, resume="never")
    stable_losses = read_losses(stable)
    before = tree_digest(stable)

    for step, fraction in ((4, 0.5), (8, 0.25)):
        decay_steps = round(fraction * step)
        over = [*BASE, *branch_overrides(step, fraction)]
        assert "optim.decay=wsd" in over and f"train.max_steps={step + decay_steps}" in over
        branch = tmp_path / f"branch-{step}"
        capsys.readouterr()
        res = train(RECIPE, over, run_dir=branch, resume=str(stable / "checkpoints" / f"step_{step:08d}"))
        assert res.final_step == step + decay_steps and res.resumed_from is not None
        # a natural change of schedule: said, with the rate before and after, and not refused
        cfg = load_recipe(RECIPE, over)
        said = f"the {step} steps trained keep their rates; step {step + 1} at {lr_at(cfg, step):.2e} (the checkpoint's schedule: 3.00e-03)"
        assert said in capsys.readouterr().out
        recs = records(branch)
        assert [r["step"] for r in recs] == list(range(step + 1, step + decay_steps + 1))
        # same weights, optimizer and data position: the first loss is the stable run's at that step
        assert recs[0]["loss"] == pytest.approx(stable_losses[step + 1], rel=1e-6, abs=1e-7)
        assert recs[0]["tokens_seen"] == (step + 1) * 8 * 32
        # the rate: the recipe's wsd schedule, falling every step to min_lr at the last one
        lrs = [r["lr"] for r in recs]
        assert lrs == pytest.approx([lr_at(cfg, r["step"] - 1) for r in recs])
        assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[0] < 3e-3 and lrs[-1] == pytest.approx(3e-4)
        # after the decay starts, the branch leaves the stable run
        if decay_steps > 1:
            assert recs[1]["loss"] != stable_losses[step + 2]
        assert (branch / "checkpoints" / f"step_{step + decay_steps:08d}").is_dir()
    assert tree_digest(stable) == before  # branching wrote nothing into the stable run


def test_a_resume_that_changes_the_rate_of_a_trained_step_is_refused_unless_allowed(tmp_path, capsys):
    """A longer cosine run re-stretches the decay over steps already trained: refused in one line naming
    the change and the fix (the run dir untouched); allowed, the run goes on under the new schedule and
    the log says the rate of the next step under both."""
    run = tmp_path / "run"
    cosine = [*BASE, "optim.decay=cosine", "checkpoint.every_steps=0"]
    train(RECIPE, [*cosine, "train.max_steps=6"], run_dir=run, resume="never")
    before = tree_digest(run)
    longer = [*cosine, "train.max_steps=10"]
    with pytest.raises(RecipeError) as refused:
        train(RECIPE, longer, run_dir=run, resume="auto")
    msg = str(refused.value)
    assert "\n" not in msg and "changes the learning-rate schedule (train.max_steps 6 -> 10)" in msg, msg
    assert msg.endswith(
        "Fix: resume with the checkpoint's schedule (train.max_steps=6), or add optim.allow_schedule_change=true to continue under the new one"
    )
    assert tree_digest(run) == before
    old, new = load_recipe(RECIPE, [*cosine, "train.max_steps=6"]), load_recipe(RECIPE, longer)
    capsys.readouterr()
    res = train(RECIPE, [*longer, "optim.allow_schedule_change=true"], run_dir=run, resume="auto")
    assert res.final_step == 10
    said = (
        "learning-rate schedule changed on resume (train.max_steps 6 -> 10; optim.allow_schedule_change): "
        f"step 7 at {lr_at(new, 6):.2e} (the checkpoint's schedule: {lr_at(old, 6):.2e})"
    )
    assert said in capsys.readouterr().out
    assert [r["lr"] for r in records(run)[6:]] == pytest.approx([lr_at(new, s) for s in range(6, 10)])
