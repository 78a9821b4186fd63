"""launch.sh --max-restarts with real processes: a ZeRO-3 rank killed at two random steps, and the run
finishes by itself with the uninterrupted run's losses; a failure that repeats at the same step stops
with one error line; bad input (exit 2) is never retried."""

from __future__ import annotations

import json
import random
import subprocess

from conftest import REPO, free_port, read_losses
from test_train_launch import launch_env

STEPS = 12
TRAIN = [
    "--recipe",
    "recipes/tiny_cpu.yaml",
    "parallel.ds_config=zero3",
    f"train.max_steps={STEPS}",
    "train.eval_every_steps=0",
    "checkpoint.every_steps=2",
    "logging.tensorboard=false",
]


def launch(run, *opts, faults=None, extra=()):
    env = launch_env() | ({"PRETRAIN_FAULTS": json.dumps(faults)} if faults else {})
    cmd = ["./launch.sh", "--cpu", "2", "--master-port", str(free_port()), *opts, "--", *TRAIN, "--run-dir", str(run)]
    return subprocess.run([*cmd, *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_a_killed_rank_restarts_and_the_losses_equal_the_uninterrupted_run(tmp_path):
    kills = sorted(random.sample(range(2, STEPS), 2))
    healed = launch(
        tmp_path / "healed",
        "--max-restarts",
        "4",
        "--restart-backoff",
        "0",
        faults={"kill_steps": kills, "kill_rank": 1},
    )
    assert healed.returncode == 0, healed.stderr[-3000:]
    restarts = [json.loads(line) for line in (tmp_path / "healed" / "restarts.jsonl").read_text().splitlines()]
    assert [r["restart"] for r in restarts] == [1, 2] and [r["after_step"] for r in restarts] == kills
    assert healed.stderr.count("[launch] the job exited with") == 2
    plain = launch(tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert read_losses(tmp_path / "healed") == read_losses(tmp_path / "plain")  # bitwise, every step
    last = json.loads((tmp_path / "healed" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == STEPS and last["restarts"] == 2


def test_the_same_failure_twice_stops_and_bad_input_is_not_retried(tmp_path):
    nan = {"nan_batches": [4]}  # the same batch is non-finite at every attempt: exit 3 after step 4
    run = launch(
        tmp_path / "nan", "--max-restarts", "5", "--restart-backoff", "0", faults=nan, extra=["train.nan_policy=stop"]
    )
    assert run.returncode == 3
    assert run.stderr.count("[launch] the job exited with 3 after step 4") == 1
    assert "error: the run failed the same way twice (exit 3 after step 4)" in run.stderr
    assert len((tmp_path / "nan" / "restarts.jsonl").read_text().splitlines()) == 1
    bad = launch(tmp_path / "bad", "--max-restarts", "5", extra=["train.max_stepz=3"])
    assert bad.returncode == 2 and "[launch]" not in bad.stderr and not (tmp_path / "bad").exists()


def test_a_restart_of_a_job_on_two_nodes_is_one_line(tmp_path):
    """With --no-ssh each node's launch.sh restarts its own ranks when the job fails, so both restart; the job
    restarted once, and restarts.jsonl (and the metrics' `restarts`) says once: node 0's launcher writes it. The
    job is a stand-in that fails at once (PYTHON); launch.sh's bookkeeping is the real one."""
    run = tmp_path / "run"
    job = tmp_path / "python"
    job.write_text(f'#!/bin/bash\ncase " $* " in *" --print-run-dir "*) echo {run} ;; *) exit 3 ;; esac\n')
    job.chmod(0o755)
    (tmp_path / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    run.mkdir()
    for node in (0, 1):
        cmd = ["./launch.sh", "--cpu", "1", "--hostfile", str(tmp_path / "hostfile"), "--no-ssh", "--node-rank"]
        cmd += [str(node), "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "1"]
        cmd += ["--restart-backoff", "0", "--", *TRAIN, "--run-dir", str(run)]
        out = subprocess.run(cmd, cwd=REPO, env=launch_env() | {"PYTHON": str(job)}, capture_output=True, text=True)
        assert out.returncode == 3, out.stdout + out.stderr
        assert "[launch] the job exited with 3 after step 0; restart 1 of 1" in out.stderr
        assert "error: the run failed (exit 3 after step 0) and --max-restarts 1 are used up" in out.stderr
    assert [json.loads(line)["restart"] for line in (run / "restarts.jsonl").read_text().splitlines()] == [1]
