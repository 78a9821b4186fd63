"""scripts/gpu_check.sh --rehearse: every stage of the lent GPU's check runs on the CPU at a tiny size,
so the script has not rotted by the time a device is lent; a failing stage is recorded and the rest
still run. Real processes throughout (launch.sh, DeepSpeed, gloo, the benchmark's workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_rehearsal_runs_every_stage_and_records_a_failure(tmp_path):
    out_dir = tmp_path / "out"
    env = dict(
        {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")},
        OUT=str(out_dir),
        GPU_CHECK_WORK=str(tmp_path / "work"),
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        # one training cell of the matrix, after one that cannot work (an unknown ZeRO config)
        GPU_CHECK_VARIANTS="mixit",
        GPU_CHECK_ZERO="zero9 zero3",
    )
    out = subprocess.run(
        ["scripts/gpu_check.sh", "--rehearse"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    log = out.stdout + out.stderr
    assert out.returncode == 1, log  # one stage failed

    rows = {}
    lines = (out_dir / "summary.txt").read_text().splitlines()
    assert lines[0].split()[:3] == ["stage", "status", "seconds"]
    for line in lines[1:]:
        stage, status, seconds, *keys = line.split(maxsplit=3)
        rows[stage] = (status, int(seconds), keys[0] if keys else "")
    expected = [
        "wheels",
        "probe",
        "pytest",
        "train:mixit:zero9",
        "train:mixit:zero3",
        "bench:T64",
        "bench:compiled:T64",
        "bench:mixit_memory",
    ]
    assert list(rows) == expected, lines
    assert rows["train:mixit:zero9"][0] == "FAIL", rows
    assert "zero9" in (out_dir / "logs" / "train_mixit_zero9.log").read_text()
    assert all(rows[s][0] == "PASS" for s in expected if s != "train:mixit:zero9"), lines
    assert log.rstrip().endswith(lines[-1])  # the table closes the output

    # key numbers: versions and a measured matmul rate; GPU tests collected (and skipped on a CPU)
    import torch

    assert f"torch {torch.__version__}" in rows["probe"][2] and "TFLOP/s" in rows["probe"][2]
    assert "skipped" in rows["pytest"][2]
    # training: the checkpoint at step 3 resumed, steps 4-5 repeated with the same losses (gloo, fp32: exact)
    assert "resumed steps 4-5 |dloss| 0 " in rows["train:mixit:zero3"][2], rows
    train_dir = out_dir / "train" / "mixit_zero3"
    ref = [json.loads(x) for x in (train_dir / "uninterrupted.jsonl").read_text().splitlines()]
    res = [json.loads(x) for x in (train_dir / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5] and [r["step"] for r in res] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in ref] == [r["loss"] for r in res]
    assert "step_00000003" in (out_dir / "logs" / "train_mixit_zero3.log").read_text()
    # the GPU plan was checked too: the 1b shape at vocab 128,256, bf16
    train_log = (out_dir / "logs" / "train_mixit_zero3.log").read_text()
    assert "vocab_size: 128256" in train_log and "precision: bf16" in train_log
    # benchmark: a tok/s for each variant, a MixiT memory row per implementation
    for variant in ("standard", "frozen_qk", "mixit"):
        assert f"{variant} " in rows["bench:T64"][2] and "tok/s" in rows["bench:T64"][2]
    assert "standard " in rows["bench:compiled:T64"][2] and "mixit " in rows["bench:compiled:T64"][2]
    assert rows["bench:mixit_memory"][2].startswith("2 rows")


def test_device_wheels_plan_builds_deepspeed_and_leaves_out_the_image():
    """`scripts/device_wheels.sh --list`: the plan, nothing downloaded."""
    out = subprocess.run(["scripts/device_wheels.sh", "--list"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    planned = {line.split()[0] for line in lines if line.startswith("  ") and ("=" in line.split()[0])}
    assert "deepspeed==0.19.8" in planned, out.stdout
    # what the image has is not downloaded again: torch least of all, and pytest (the image holds it)
    assert not any(p.startswith(("torch", "triton", "transformers", "numpy", "pytest")) for p in planned), planned
    assert "torch" in next(x for x in lines if "image provides" in x).split()
