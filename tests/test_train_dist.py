"""Two real CPU processes (gloo): every layout gives the single-process losses; under ZeRO 1/2/3 a
kill -9 + --resume auto continues the same losses and keeps frozen tensors bit-identical; a universal
checkpoint resumes on a different world size."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import fault_seed, read_losses, run_ranks, start_ranks, wait_for_steps

from checkpoint import load_for_eval
from checkpoint import tag_format as ckpt
from pretrain.train import train
from pretrain.universal import to_universal

RECIPE = "recipes/tiny_cpu.yaml"
# frozen_qk with tied embeddings: frozen tensors to preserve, and a tied pair across pipeline stages.
COMMON = [
    "model.variant=frozen_qk",
    "model.tie_embeddings=true",
    "train.max_steps=10",
    "train.eval_every_steps=0",
    "logging.tensorboard=false",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=0",
]
TOL = dict(rel=1e-5, abs=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, ZeRO-1, same recipe, data and global batch."""
    res = train(RECIPE, COMMON, run_dir=tmp_path_factory.mktemp("ref"), resume="never")
    model, _ = load_for_eval(res.run_dir / "checkpoints" / ckpt.tag_for(5))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".q_proj." in n or ".k_proj." in n for n in frozen)
    return res, frozen


def assert_losses_match(got: dict[int, float], want: dict[int, float], steps):
    for s in steps:
        assert got[s] == pytest.approx(want[s], **TOL), f"step {s}: {got[s]} vs {want[s]}"


def assert_frozen_identical(tag_dir, frozen):
    saved = ckpt.load_frozen(tag_dir)
    model, _ = load_for_eval(tag_dir)
    params = dict(model.named_parameters())
    for n, t in frozen.items():
        assert torch.equal(saved[n], t) and saved[n].dtype == t.dtype, n
        assert torch.equal(params[n].detach(), t), n


@pytest.mark.parametrize("zero", ["zero1", "zero2", "zero3"])
def test_zero_two_ranks_match_one_across_kill9_resume_keep_frozen(zero, reference, tmp_path):
    ref, frozen = reference
    run = tmp_path / "run"
    args = ["--recipe", RECIPE, "--run-dir", str(run), f"parallel.ds_config={zero}", *COMMON]
    # kill -9 both ranks at a random step after the step-5 checkpoint, then --resume auto
    procs = start_ranks(args)
    wait_for_steps(run, random.Random(fault_seed()).randint(6, 8), procs)
    for p in procs:
        p.kill()
        p.wait()
    assert ckpt.latest_checkpoint(run).name == ckpt.tag_for(5)
    out = run_ranks([*args, "--resume", "auto"])
    assert "resumed from" in out and ckpt.tag_for(5) in out
    assert sorted(read_losses(run)) == list(range(1, 11))
    assert_losses_match(read_losses(run), ref.losses, range(1, 11))  # same as one process, across the kill
    assert_frozen_identical(run / "checkpoints" / ckpt.tag_for(5), frozen)
    assert_frozen_identical(run / "checkpoints" / ckpt.tag_for(10), frozen)
    if zero == "zero1":
        # universal checkpoint: 2 ranks -> 1 process, continues the same loss sequence
        uni = to_universal(run / "checkpoints" / ckpt.tag_for(5), tmp_path / "universal")
        res = train(RECIPE, [f"parallel.ds_config={zero}", *COMMON], run_dir=tmp_path / "one", resume=str(uni))
        assert sorted(res.losses) == list(range(6, 11))
        assert_losses_match(res.losses, ref.losses, range(6, 11))
        assert_frozen_identical(res.last_checkpoint, frozen)


def test_two_pipeline_stages_match_one_process(reference, tmp_path):
    ref, frozen = reference
    run = tmp_path / "pipe"
    run_ranks(
        [
            "--recipe",
            RECIPE,
            "--run-dir",
            str(run),
            "parallel.ds_config=pipeline",
            "parallel.pipeline_stages=2",
            *COMMON,
        ]
    )
    assert_losses_match(read_losses(run), ref.losses, range(1, 11))
    tag = run / "checkpoints" / ckpt.tag_for(10)
    assert sorted(p.name for p in tag.glob("frozen-stage*")) == [
        "frozen-stage0.safetensors",
        "frozen-stage1.safetensors",
    ]
    assert_frozen_identical(tag, frozen)
    # the exported tied model equals the single-process one
    a, _ = load_for_eval(tag)
    b, _ = load_for_eval(ref.run_dir)
    assert a.lm_head.weight is a.embed_tokens.weight
    for k, v in b.state_dict().items():
        assert torch.allclose(a.state_dict()[k], v, rtol=1e-4, atol=1e-5), k
