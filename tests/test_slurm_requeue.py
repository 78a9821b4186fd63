"""Slurm requeue, run locally: the array script `studies.scaling sweep --slurm` writes asks for a warning
signal before the time limit and requeueing; USR1 to the batch script (which execs launch.sh) makes
every rank checkpoint and calls `scontrol requeue` (a stand-in on PATH that records the call), and
running the script again, as the requeued job does, resumes where it stopped."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

from conftest import REPO, read_losses

from checkpoint import tag_format as ckpt
from studies.scaling.cli import main

SRUN = """#!/bin/bash
# srun stand-in: one task on this machine, with the variables srun gives it
while [[ "$1" == --* ]]; do shift; done
exec env SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 SLURM_NNODES=1 SLURM_NTASKS_PER_NODE=1 "$@"
"""
SCONTROL = """#!/bin/bash
# scontrol stand-in: records its arguments; `show hostnames` names this machine
echo "$*" >> "$SCONTROL_LOG"
[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1
exit 0
"""


def test_usr1_before_the_time_limit_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path):
    out = tmp_path / "sweep"
    over = ["train.max_steps=40", "train.eval_every_steps=0", "checkpoint.every_steps=0", "logging.tensorboard=false"]
    assert (
        main(
            ["sweep", "--recipe", "recipes/tiny_cpu.yaml", "--variants", "standard", "--sizes", "tiny"]
            + ["--out", str(out), "--slurm", *over]
        )
        == 0
    )
    script = (out / "sweep.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@300" in script and "#SBATCH --requeue" in script and "exec ./launch.sh" in script
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    job = random.randint(1000, 9999)  # launch.sh's port: 20000 + job % 10000
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    env |= {"PATH": f"{bin_dir}:{env['PATH']}", "SCONTROL_LOG": str(tmp_path / "scontrol.log"), "DS_ACCELERATOR": "cpu"}
    env |= {
        "SLURM_JOB_ID": str(job),
        "SLURM_ARRAY_TASK_ID": "0",
        "SLURM_JOB_NODELIST": "localhost",
        "OMP_NUM_THREADS": "1",
    }
    run = out / "runs" / "standard-tiny-s0"
    proc = subprocess.Popen(
        ["bash", str(out / "sweep.sbatch")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics, deadline = run / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)  # Slurm: the time limit is 300 s away
    first = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, first[-3000:]
    assert f"requeue {job}" in (tmp_path / "scontrol.log").read_text().splitlines()
    stopped = max(read_losses(run))
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None and ckpt.read_state(latest)["step"] == stopped < 40
    second = subprocess.run(
        ["bash", str(out / "sweep.sbatch")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resumed from {latest}" in second.stdout
    assert sorted(read_losses(run)) == list(range(1, 41))
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == 40
