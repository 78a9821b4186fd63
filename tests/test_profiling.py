"""profile.* recipe keys: a torch profiler trace of the chosen steps holds the model's forward ops;
a CUDA memory snapshot asked for on a CPU run is said to be CUDA-only and the run goes on; the
profiler's native status lines stay out of the log."""

from __future__ import annotations

import json

import pytest

from common.errors import RecipeError
from pretrain.train import train

BASE = ["train.max_steps=4", "checkpoint.every_steps=0", "logging.tensorboard=false"]


def test_profile_steps_write_a_trace_with_the_forward_ops(tmp_path, capfd):
    run = tmp_path / "run"
    over = [*BASE, "profile.steps=[2, 3]", "profile.record_shapes=true", "profile.memory=true"]
    train("recipes/tiny_cpu.yaml", over, run_dir=run, resume="never")
    out, err = capfd.readouterr()  # what reaches the file descriptors, the native library's writes included
    assert "memory snapshot is CUDA-only" in out
    assert "profiler_start" not in out + err and "USDT" not in out + err  # no stray native status lines
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0.steps2-3.pt.trace.json"]
    events = json.loads((run / "profile" / "rank0.steps2-3.pt.trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    # the model's forward: its embedding and its projections (aten::linear; aten::matmul where a ZeRO-3 run
    # earlier in this process left DeepSpeed's linear in torch.nn.functional, as DeepSpeed does not restore it)
    products = {"aten::linear", "aten::matmul"} & names
    assert "aten::embedding" in names and products
    assert any(n and "backward" in n.lower() for n in names)  # and its backward
    assert any(e.get("args", {}).get("Input Dims") for e in events if e.get("name") in products)
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names  # each step's bounds, as viewers expect them
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4  # the run went on


@pytest.mark.parametrize("steps", ["[3, 2]", "[0, 1]", "[2]"])
def test_bad_profile_steps_refused_before_work(tmp_path, steps):
    with pytest.raises(RecipeError, match="profile.steps must be"):
        train("recipes/tiny_cpu.yaml", [*BASE, f"profile.steps={steps}"], run_dir=tmp_path / "r", resume="never")
    assert not (tmp_path / "r").exists()
