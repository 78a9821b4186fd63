"""Shared fixtures: spawn real training ranks (gloo on CPU), read their metrics, and mount a
small real filesystem that fills up (tmpfs)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.constants import free_port

REPO = Path(__file__).resolve().parent.parent


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    return env


def start_ranks(args: list[str], world: int = 2) -> list[subprocess.Popen]:
    """Start `python -m pretrain.train ARGS` as `world` real processes (gloo)."""
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "pretrain.train", *args],
            cwd=REPO,
            env=rank_env(r, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def wait_for_steps(run_dir: Path, steps: int, procs, timeout: float = 300) -> None:
    """Block until metrics.jsonl has `steps` records (fails if the processes end first)."""
    deadline = time.time() + timeout
    m = Path(run_dir) / "metrics.jsonl"
    while time.time() < deadline:
        if m.is_file() and len(m.read_text().splitlines()) >= steps:
            return
        assert all(p.poll() is None for p in procs), "training ended before the expected step"
        time.sleep(0.05)
    raise TimeoutError(f"no step {steps} in {m}")


def finish_ranks(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Every rank's output once it ends; a rank still running after `timeout` (or the test failing) is killed."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_ranks(args: list[str], world: int = 2, timeout: float = 300) -> str:
    """Run `python -m pretrain.train ARGS` as `world` real processes; return rank 0's output."""
    procs = start_ranks(args, world)
    outs = finish_ranks(procs, timeout)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{outs[r][-4000:]}"
    return outs[0]


def fault_seed() -> int:
    """The seed of a test's random fault (e.g. the step of a kill -9), printed so that pytest shows it
    with a failure; PRETRAIN_TEST_SEED=<seed> replays that run."""
    seed = int(os.environ.get("PRETRAIN_TEST_SEED") or random.SystemRandom().randrange(2**32))
    print(f"fault seed {seed} (replay with PRETRAIN_TEST_SEED={seed})")
    return seed


def read_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (a later record of the same step wins)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


class Tmpfs:
    """A tmpfs mounted by a test: a real filesystem whose writes fail with ENOSPC when it is full."""

    def __init__(self, path: Path):
        self.path = path

    def used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def resize(self, size_bytes: int) -> None:
        subprocess.run(
            ["mount", "-o", f"remount,size={int(size_bytes)}", str(self.path)], check=True, capture_output=True
        )


@pytest.fixture
def small_tmpfs(tmp_path):
    """`small_tmpfs(path, size_bytes)` mounts a tmpfs there (unmounted after the test). Mounting
    needs root (CAP_SYS_ADMIN), as the CI machines have: without it the test fails, loudly,
    rather than testing a stand-in for a full disk."""
    mounted: list[Path] = []

    def mount(where: Path, size_bytes: int) -> Tmpfs:
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={int(size_bytes)}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.fail(
                f"this test needs a real filesystem that fills up: mounting a tmpfs at {where} failed "
                f"({(r.stderr or r.stdout).strip()}). Run the tests as root (or with CAP_SYS_ADMIN), as CI does",
                pytrace=False,
            )
        mounted.append(where)
        return Tmpfs(where)

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def pytest_collection_modifyitems(config, items):
    """The slow tests first, the README journey (the longest) first of all: with two workers the
    long tests start early instead of running alone at the end."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, "test_readme.py" not in item.nodeid))
