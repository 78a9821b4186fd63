"""pretrain/orphan.py on real processes: SIGTERM when the launcher PID dies (on its own host only),
and a parent-death signal for launched ranks but never for a plain (e.g. nohup) process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO

from studies.rows import read_rows
from studies.scaling.runs import ATTEMPTS, DONE

# A stand-in rank: the trainer's SIGTERM handler, then the one call pretrain.train makes at startup.
RANK = """
import ctypes, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM", flush=True), sys.exit(0)))
from pretrain import orphan
watchdog = orphan.stop_when_launcher_dies(poll_s=0.05)
pdeathsig = ctypes.c_int(0)
ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)    # PR_GET_PDEATHSIG
print("ready", watchdog is not None, pdeathsig.value, flush=True)
time.sleep(float(sys.argv[1]))
print("timeout", flush=True)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux")


def start_rank(env_extra: dict[str, str], wait_s: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "PRETRAIN_LAUNCHER")}
    env.update(env_extra, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, str(wait_s)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc


@pytest.mark.parametrize("host_matches", [True, False])
def test_launcher_death_sends_sigterm_on_its_host_only(host_matches):
    launcher = subprocess.Popen(["sleep", "60"])
    host = socket.gethostname() if host_matches else socket.gethostname() + "-elsewhere"
    rank = start_rank({"PRETRAIN_LAUNCHER": f"{host} {launcher.pid}"}, wait_s=3 if not host_matches else 30)
    try:
        assert rank.stdout.readline().split() == ["ready", str(host_matches), "0"]
        launcher.kill()  # not reaped yet: a zombie counts as gone
        t0 = time.time()
        out, err = rank.communicate(timeout=40)
    finally:
        launcher.kill()
        launcher.wait()
        rank.kill()
    if host_matches:  # noticed within a few polls, through the SIGTERM handler
        assert out.split() == ["SIGTERM"] and time.time() - t0 < 5, err
        assert f"launcher (pid {launcher.pid}) is gone" in err
    else:  # another host's PID means nothing here: no watchdog, no signal
        assert out.split() == ["timeout"], err


def test_launcher_already_gone_at_startup_stops_at_once():
    launcher = subprocess.Popen(["true"])
    launcher.wait()
    rank = start_rank({"PRETRAIN_LAUNCHER": f"{socket.gethostname()} {launcher.pid}"}, wait_s=30)
    out, err = rank.communicate(timeout=40)
    assert out.split() == ["SIGTERM"], err


def test_parent_death_signal_only_for_launched_ranks():
    """A launched rank (LOCAL_RANK set) asks for SIGTERM on its parent's death; a plain process, which
    may be running under nohup after its shell left, does not, and starts no watchdog."""
    plain = start_rank({}, wait_s=0)
    assert plain.communicate(timeout=40)[0].split() == ["ready", "False", "0", "timeout"]
    launched = start_rank({"LOCAL_RANK": "0"}, wait_s=0)
    assert launched.communicate(timeout=40)[0].split() == ["ready", "False", str(int(signal.SIGTERM)), "timeout"]


# A study driver (studies/scaling/runs.py) training one long run as its own process, as a study does
# (run_chains under run_cli).
DRIVER = """
import sys
from pathlib import Path
from common.cli import run_cli
from studies.scaling.runs import run_chains, train_once
run = Path(sys.argv[1])
args = ["--recipe", "recipes/tiny_cpu.yaml", "--run-dir", str(run), "train.max_steps=100000",
        "train.eval_every_steps=0", "checkpoint.every_steps=0", "logging.every_steps=1", "logging.tensorboard=false"]
chains = [lambda: [] if train_once(args, run, {}) else ["run"], lambda: print("the second chain started") or []]
sys.exit(run_cli(lambda: len(run_chains(chains, 1))))
"""


def start_driver(run):
    """The driver, once its run has logged a step (its output: a pipe it shares with the run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "PRETRAIN_LAUNCHER")}
    env.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu")
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(run)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
        if time.time() > deadline or driver.poll() is not None:
            driver.kill()
            pytest.fail(f"the run did not start:\n{driver.communicate()[0].decode()[-3000:]}")
        time.sleep(0.2)
    return driver


def test_a_study_run_saves_and_stops_when_its_driver_dies(tmp_path):
    """Killing a study's driver does not leave its run training on, unrecorded: the run notices the
    launcher it was given is gone, saves a checkpoint and stops."""
    run = tmp_path / "run"
    driver = start_driver(run)
    try:
        driver.kill()
        out = driver.communicate(timeout=60)[0].decode()  # EOF once the run, which shares the pipe, has exited
    finally:
        driver.kill()
        subprocess.run(["pkill", "-f", str(run)])  # the run, were it still training
    assert f"launcher (pid {driver.pid}) is gone" in out, out[-3000:]
    assert "signal received: saving a checkpoint" in out
    assert list((run / "checkpoints").glob("step_*")), out[-3000:]


def test_sigterm_to_a_study_stops_its_run_with_a_checkpoint_records_its_time_and_not_done(tmp_path):
    """SIGTERM to the driver alone: it passes the stop to its run, which saves a checkpoint and exits 0;
    the driver records the process's time, does not mark the run finished (it did not reach its last
    step), starts no further chain and ends with one error line saying how to resume."""
    run = tmp_path / "run"
    driver = start_driver(run)
    try:
        driver.send_signal(signal.SIGTERM)
        out = driver.communicate(timeout=120)[0].decode()
    finally:
        driver.kill()
        subprocess.run(["pkill", "-f", str(run)])
    assert driver.returncode == 3 and "signal received: saving a checkpoint" in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: the study was stopped (SIGTERM); its runs in flight saved a checkpoint and their time is "
        "recorded. Fix: re-run the same command to resume"
    ], out[-3000:]
    assert list((run / "checkpoints").glob("step_*")) and not (run / DONE).exists()
    assert "the second chain started" not in out
    (attempt,) = read_rows(run / ATTEMPTS)
    assert attempt["exit_code"] == 0 and attempt["cpu_seconds"] > 0.5 and attempt["seconds"] > 0.5
