"""The trainer's speed options against its plain path on the CPU: `train.activation_checkpointing`
(none | selective | full | auto), `train.compile` and fused AdamW give the plain run's losses; the recipe's earlier
true/false still read; the engine applies what it logs."""

from __future__ import annotations

import pytest
import torch

from common.errors import RecipeError
from pretrain import parallelize
from pretrain.config import load_recipe
from pretrain.engine import ModelEngine
from pretrain.layout import plan_layout
from pretrain.train import train

RECIPE = "recipes/tiny_cpu.yaml"
STEPS = 3
FAST = [
    "train.eval_every_steps=0",
    "logging.tensorboard=false",
    f"train.max_steps={STEPS}",
    "checkpoint.save_final=false",
    "model.num_kv_heads=2",
]


def engines(monkeypatch) -> list[ModelEngine]:
    """Every ModelEngine built from now on, once built."""
    seen = []
    orig = ModelEngine.build

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen.append(self)

    monkeypatch.setattr(ModelEngine, "build", spy)
    return seen


def losses(tmp_path, name, *over):
    return train(RECIPE, FAST + list(over), run_dir=tmp_path / name, resume="never").losses


@pytest.mark.parametrize("variant", ["standard", "mixit"])
def test_checkpointing_modes_train_as_the_plain_path(tmp_path, monkeypatch, variant):
    """fp32, ZeRO-1 on one CPU rank: none, selective and full give the same losses bit for bit; auto picks
    `none` for a tiny model (it fits any host) and says why."""
    built = engines(monkeypatch)
    recomputed = []  # the context each block's recomputation ran under, one entry per block and micro-batch
    orig_checkpoint = parallelize.checkpoint

    def spy(*a, **k):
        recomputed.append(k.get("context_fn"))
        return orig_checkpoint(*a, **k)

    monkeypatch.setattr(parallelize, "checkpoint", spy)
    plain = losses(tmp_path, "none", f"model.variant={variant}")
    assert sorted(plain) == list(range(1, STEPS + 1))
    assert recomputed == []
    blocks = sum(isinstance(m, parallelize.Block) for m in built[0].model.modules())
    calls = {}
    for mode in ("selective", "full", "auto"):
        before = len(recomputed)
        got = losses(tmp_path, mode, f"model.variant={variant}", f"train.activation_checkpointing={mode}")
        assert got == plain, (mode, got, plain)
        calls[mode] = recomputed[before:]
    assert [e.checkpointing for e in built] == ["none", "selective", "full", "none"]
    # the blocks really were recomputed, under the mode's policy: one checkpoint a block and micro-batch
    micro_batches = STEPS * 8 // 4  # tiny_cpu: 8 sequences a step, 4 a forward
    assert len(calls["selective"]) == len(calls["full"]) == blocks * micro_batches, (blocks, calls)
    assert all(c is not None for c in calls["selective"]) and all(c is None for c in calls["full"])
    assert calls["auto"] == []
    assert built[-1].checkpointing_reason.startswith("auto: none ")


def test_compiled_blocks_train_as_the_plain_path(tmp_path, monkeypatch):
    """`train.compile` compiles every block in place around its checkpointing wrapper (selective here, the
    hardest to trace): the losses are the eager run's. Traced with `aot_eager` (dynamo and AOT autograd, no
    code generation: seconds); inductor's numerics against eager are tests/test_kernels_loss.py's."""
    monkeypatch.setattr(parallelize, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    built = engines(monkeypatch)
    over = ["model.variant=standard", "train.activation_checkpointing=selective"]
    eager = losses(tmp_path, "eager", *over)
    compiled = losses(tmp_path, "compiled", *over, "train.compile=true")
    blocks = [m for m in built[-1].model.modules() if isinstance(m, parallelize.Block)]
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo captured the blocks (not only wrapped them)
    assert all(b._compiled_call_impl is None for b in built[0].model.modules() if isinstance(b, parallelize.Block))
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    names = [n for n, _ in built[-1].model.named_parameters()]
    assert names == [n for n, _ in built[0].model.named_parameters()]  # in place: no _orig_mod


def test_fused_adamw_trains_as_the_foreach_step(tmp_path, monkeypatch):
    """`optim.fused` (the default, on every device torch has the kernel for: CPU and CUDA) against torch's
    foreach AdamW: the same losses to float32 rounding, and each run's optimizer is the one asked for."""
    built = engines(monkeypatch)
    fused = losses(tmp_path, "fused", "optim.fused=true")
    foreach = losses(tmp_path, "foreach", "optim.fused=false")
    assert [bool(e.inner_optimizer.defaults["fused"]) for e in built] == [True, False]
    assert sorted(fused) == list(range(1, STEPS + 1))
    for step, loss in foreach.items():
        assert fused[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert fused[STEPS] != fused[1]  # the steps moved the weights


def test_checkpointing_reads_its_earlier_booleans_and_refuses_other_values():
    assert load_recipe(RECIPE, ["train.activation_checkpointing=true"]).train.activation_checkpointing == "full"
    assert load_recipe(RECIPE, ["train.activation_checkpointing=false"]).train.activation_checkpointing == "none"
    with pytest.raises(
        RecipeError, match=r"must be one of \['none', 'selective', 'full', 'auto'\].*did you mean 'full'"
    ):
        load_recipe(RECIPE, ["train.activation_checkpointing=fulll"])


def test_compile_with_zero3_is_refused_in_one_line_before_any_work():
    cfg = load_recipe(RECIPE, ["train.compile=true", "parallel.ds_config=zero3"])
    with pytest.raises(RecipeError, match=r"^train.compile with ZeRO-3: .* Fix: parallel.ds_config=zero1 or zero2"):
        plan_layout(cfg, 1)
