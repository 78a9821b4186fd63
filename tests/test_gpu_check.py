"""scripts/gpu_check.sh --rehearse: every stage of the lent GPU's check runs on the CPU at a tiny size,
so the script has not rotted by the time a device is lent; a failing stage is recorded and the rest
still run. Real processes throughout (launch.sh, DeepSpeed, gloo, the benchmark's workers).
`--plan`: the device plan's seconds come from docs/data/gpu's stage times or say they are estimates, a
plan over its budget is refused, and `--plan --rehearse` checks the plan's GPU commands on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PLAN = ["wheels", "probe", "pytest", "bench:T2048", "bench:T8192"]


def gpu_check(*args: str, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["scripts/gpu_check.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def plan_rows(stdout: str) -> dict[str, tuple[int, str]]:
    """The plan's stage rows: name -> (seconds, basis)."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"^  (\S+) +(\d+)  (.*)$", line)
        if m and m.group(1) not in ("stage", "total"):
            rows[m.group(1)] = (int(m.group(2)), m.group(3))
    return rows


def test_plan_prints_each_stage_with_its_measured_seconds_or_an_estimate():
    out = gpu_check("--plan")
    assert out.returncode == 0, out.stderr
    rows = plan_rows(out.stdout)
    assert list(rows) == DEFAULT_PLAN  # the compiled and scaling stages are left out: their time is not left
    assert re.search(r"^left out: bench:compiled:T2048 \(\d+ s, measured\)", out.stdout, re.M), out.stdout
    assert re.search(r"^left out: bench:T16384 \(\d+ s, ESTIMATE\)", out.stdout, re.M), out.stdout
    total = int(re.search(r"^  total +(\d+)  of the 540 s budget", out.stdout, re.M).group(1))
    assert total == sum(s for s, _ in rows.values()) <= 540
    for stage, (seconds, basis) in rows.items():
        assert basis.startswith(("measured: docs/data/gpu/", "ESTIMATE")), (stage, basis)
        if basis.startswith("measured: "):  # the figure is the stage's row in the summary the basis names
            summary = REPO / basis.split()[1]
            times = {f[0]: int(f[2]) for f in (x.split() for x in summary.read_text().splitlines()[1:])}
            assert times[stage] == seconds, (stage, summary)
    assert "run it with: scripts/gpu_check.sh --budget 540 --only " + ",".join(DEFAULT_PLAN) in out.stdout
    # a larger budget, the most one call runs, takes the compiled stage in, and the scaling stage still does
    # not fit
    out = gpu_check("--plan", "--budget", "600")
    rows = plan_rows(out.stdout)
    assert list(rows) == [*DEFAULT_PLAN, "bench:compiled:T2048"], out.stdout
    assert f"more than the {600 - sum(s for s, _ in rows.values())} s left" in out.stdout


def test_trainer_stages_plan_every_checkpointing_mode_eager_and_compiled_as_estimates():
    """The trainer's own step at 1b: six stages, each an ESTIMATE until a device has run it; all six are over
    one call's budget, so the plan is refused and names the fix."""
    out = gpu_check("--plan", "trainer")
    assert out.returncode == 2 and "over the 540 s budget" in out.stderr, out.stdout + out.stderr
    rows = plan_rows(out.stdout)
    modes = ("none", "selective", "full")
    assert list(rows) == [f"trainer:{m}:{h}" for h in ("eager", "compiled") for m in modes], rows
    assert all(basis.startswith("ESTIMATE, never run") for _, basis in rows.values())
    eager = "trainer:none:eager,trainer:selective:eager,trainer:full:eager"
    assert gpu_check("--plan", eager).returncode == 0


def test_a_stages_own_name_selects_it_alone_and_a_prefix_several():
    assert list(plan_rows(gpu_check("--plan", "pytest").stdout)) == ["pytest"]
    assert list(plan_rows(gpu_check("--plan", "pytest:mixit").stdout)) == ["pytest:mixit"]
    env = dict(os.environ, GPU_CHECK_VARIANTS="mixit", GPU_CHECK_ZERO="zero1 zero3")
    out = gpu_check("--plan", "train", env=env)
    assert out.returncode == 0 and list(plan_rows(out.stdout)) == ["train:mixit:zero1", "train:mixit:zero3"], out


def test_plan_over_its_budget_is_refused_with_one_error_line():
    stages = "bench:T2048,bench:T8192,train:standard:zero1,pytest"  # 548 s by the plan's figures
    out = gpu_check("--plan", stages)
    assert out.returncode == 2, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the plan's stages take ") and "Fix: " in lines[0], lines
    assert "over the 540 s budget" in lines[0] and "run it with" not in out.stdout
    assert gpu_check("--plan", stages, "--budget", "600").returncode == 0  # --budget moves the limit
    for bad in (["--plan", "wheels,nope"], ["--plan", "--budget", "700"], ["--plan", "--only", "probe"]):
        out = gpu_check(*bad)
        assert out.returncode == 2 and out.stderr.startswith("error: ") and "Fix: " in out.stderr, (bad, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_plan_rehearsal_checks_the_gpu_commands_on_the_cpu(tmp_path):
    """The plan's own commands, checked where no GPU is: the benchmark's --dry-run at preset 1b, pytest's
    collection, and the wheelhouse against what one device call carries (here 65 MiB: refused)."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    with open(wheels / "big-1.0-py3-none-any.whl", "wb") as f:
        f.truncate(65 * 2**20)  # sparse: its size without writing it
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"), PYTHON=sys.executable)
    env.update(OMP_NUM_THREADS="1", GPU_CHECK_WHEELS=str(wheels))
    out = gpu_check(
        "--plan", "wheels,pytest:mixit,bench:T8192,trainer:full:compiled", "--rehearse", env=env, timeout=300
    )
    assert out.returncode == 1, out.stdout + out.stderr  # the wheelhouse's stage failed, the rest ran
    rows = {}
    for line in (tmp_path / "out" / "summary.txt").read_text().splitlines()[1:]:
        stage, status, _seconds, *keys = line.split(maxsplit=3)
        rows[stage] = (status, keys[0] if keys else "")
    assert list(rows) == ["wheels", "pytest:mixit", "bench:T8192", "trainer:full:compiled"]
    # the trainer stage's GPU command (the 1b recipe, 24 steps, full checkpointing, compiled) plans a run
    assert rows["trainer:full:compiled"] == ("PASS", "the GPU run's arguments plan a run (--dry-run)"), rows
    trainer_log = (tmp_path / "out" / "logs" / "trainer_full_compiled.log").read_text()
    assert "compile: true" in trainer_log and "activation checkpointing: full" in trainer_log
    assert "steps: 24" in trainer_log and "memory per rank by checkpointing mode" in trainer_log
    assert rows["wheels"][0] == "FAIL" and "over the 64 MiB one device call carries" in rows["wheels"][1], rows
    assert rows["pytest:mixit"][0] == "PASS" and "tests collected" in rows["pytest:mixit"][1], rows
    assert rows["bench:T8192"] == ("PASS", "dry run: preset 1b, T 8192; entries standard frozen_qk mixit mixit_triton")


@pytest.mark.slow
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
        "pytest:mixit",
        "train:mixit:zero9",
        "train:mixit:zero3",
        "trainer:selective:eager",
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
    assert "tests collected" in rows["pytest:mixit"][2]  # the suite runs them on the CPU itself
    # training: the checkpoint at step 3 resumed, steps 4-5 repeated with the same losses (gloo, fp32: exact)
    assert "resumed steps 4-5 |dloss| 0 " in rows["train:mixit:zero3"][2], rows
    train_dir = out_dir / "train" / "mixit_zero3"
    ref = [json.loads(x) for x in (train_dir / "uninterrupted.jsonl").read_text().splitlines()]
    res = [json.loads(x) for x in (train_dir / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5] and [r["step"] for r in res] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in ref] == [r["loss"] for r in res]
    assert "step_00000003" in (out_dir / "logs" / "train_mixit_zero3.log").read_text()
    # the GPU plan was checked too: preset 1b at vocab 128,256, bf16
    train_log = (out_dir / "logs" / "train_mixit_zero3.log").read_text()
    assert "vocab_size: 128256" in train_log and "precision: bf16" in train_log
    # the trainer's step: the medians of its last steps, the MFU with its causal half, memory against the estimate
    assert re.match(
        r"selective eager \(selective; auto picks none\); steps 4-6; [\d.]+ s/step; \d+ tok/s; .*"
        r"MFU [\d.]+% of the measured [\d.e-]+ \(causal half [\d.]+%\); peak RSS [\d.]+ GiB, estimate [\d.]+ GiB",
        rows["trainer:selective:eager"][2],
    ), rows["trainer:selective:eager"]
    # benchmark: a tok/s and an MFU for each variant and the trainer's own step (DeepSpeed ZeRO-1 on gloo), a
    # MixiT memory row per implementation
    for variant in ("standard", "frozen_qk", "mixit", "trainer"):
        assert re.search(rf"\b{variant} \d+ tok/s MFU [\d.]+%", rows["bench:T64"][2]), rows["bench:T64"]
    bench_log = (out_dir / "logs" / "bench_T64.out").read_text()
    assert "shape: preset tiny, T 64: model.preset('tiny', max_seq_len=64)" in bench_log
    assert "trainer: recipes/1b_gpu_zero1.yaml: world=1" in bench_log and "ZeRO-1" in bench_log
    assert "standard " in rows["bench:compiled:T64"][2] and "mixit " in rows["bench:compiled:T64"][2]
    assert rows["bench:mixit_memory"][2].startswith("2 rows")


@pytest.mark.slow
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


@pytest.mark.parametrize(
    "args, said",
    [
        (["--seconds", "soon", "--chains", "standard-w32", "--rows", "README.md"], "--seconds must be a whole number"),
        (["--seconds", "60", "--rows", "README.md"], "no --chains or --check"),
        (
            ["--seconds", "60", "--chains", "standard-w32", "--rows", "absent.jsonl"],
            "--rows 'absent.jsonl' is not a file",
        ),
        (
            ["--seconds", "60", "--chains", "standard-w32", "--rows", "README.md", "--", "--jobs", "2"],
            "STUDY_ARGS set --jobs",
        ),
    ],
)
def test_device_isoflop_refuses_bad_input_with_one_line_before_any_work(args, said, tmp_path):
    """scripts/device_isoflop.sh: a call's minutes are few, so a wrong argument is one error line at once
    (nothing installed, unpacked or trained, $OUT untouched)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DEVICE": "cpu"}
    out = subprocess.run(
        ["scripts/device_isoflop.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and out.stderr.startswith(f"error: {said}") and out.stderr.count("\n") == 1
    assert "Fix: " in out.stderr and not (tmp_path / "out").exists()
