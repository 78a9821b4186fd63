"""The optimizer step waits for the device a fixed number of times, not once per micro-batch.

On a GPU every `.item()`, `.cpu()`, `.tolist()` or Python `bool/float/int` of a device tensor stops
the host until the queued kernels finish, so a wait per micro-batch leaves the device idle between
micro-batches. On CPU the same calls are counted through a hook on torch.Tensor while one
optimizer step runs (DeepSpeed's own calls included), at 1, 2 and 4 micro-batches per step.
"""

from __future__ import annotations

import pytest
import torch

from pretrain import engine
from pretrain.train import train

RECIPE = "recipes/tiny_cpu.yaml"
HOST_READS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__", "__index__")
MAX_READS_PER_STEP = 8  # seen: 7 (loss, skip vote, gradient-norm checks, DeepSpeed's norm bookkeeping)


def _reads_per_step(monkeypatch, tmp_path, micro: int, ds_config: str) -> list[int]:
    counts: list[int] = []
    active = [False]

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if active[0]:
                counts[-1] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    original_step = engine.ModelEngine.train_step

    def counted_step(self, batch, batch_index=None):
        counts.append(0)
        active[0] = True
        try:
            return original_step(self, batch, batch_index)
        finally:
            active[0] = False

    monkeypatch.setattr(engine.ModelEngine, "train_step", counted_step)
    over = [
        "train.max_steps=3",
        "train.eval_every_steps=0",
        "logging.tensorboard=false",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        "train.global_batch_sequences=8",
        f"train.micro_batch_sequences={micro}",
        f"parallel.ds_config={ds_config}",
    ]
    train(RECIPE, over, run_dir=tmp_path / f"micro{micro}", resume="never")
    monkeypatch.undo()
    return counts


@pytest.mark.parametrize("ds_config", ["cpu", "zero1"])
def test_host_reads_per_step_do_not_grow_with_micro_batches(monkeypatch, tmp_path, ds_config):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    by_accum = {}
    for micro in (8, 4, 2):  # grad-accum 1, 2, 4 on one rank
        counts = _reads_per_step(monkeypatch, tmp_path / ds_config, micro, ds_config)
        assert len(counts) == 3
        by_accum[8 // micro] = counts[-1]  # a step after the first (warm caches, no first-step work)
    assert by_accum[1] == by_accum[2] == by_accum[4], by_accum
    assert 0 < by_accum[1] <= MAX_READS_PER_STEP, by_accum
