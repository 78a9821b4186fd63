"""Running a scaling study's training processes: one process per run, K at a time, and a durable row
per finished run.

A run is `python -m pretrain.train ARGS` in its own process. A run that trained to its last step gets
`sweep_done.json` (the wall and CPU seconds of all its processes) in its directory and, with a row log,
one JSON line of its results (`collect_run`) appended to that log, which outlives the run directories:
a study resumes from its rows on a machine where the runs themselves are gone, and the rows are what a
page cites. SIGTERM to a study stops its runs in flight with a checkpoint and records their time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from common.constants import REPO_ROOT
from common.errors import RunStopped, StudyError
from model import ModelConfig, param_count
from model.flops import flops_per_token
from model.transformer import build_model
from pretrain.config import load_recipe
from pretrain.metrics import read_metrics
from pretrain.orphan import LAUNCHER_ENV
from pretrain.run_dir import read_config

from ..rows import append_row, read_rows, update_rows

DONE = "sweep_done.json"  # a finished run: the wall and CPU seconds of all its processes, and the study's record
ATTEMPTS = "attempts.jsonl"  # one row per training process of a run, finished or not: its seconds and exit code
_STOPPING = threading.Event()  # set by SIGTERM to a study (`_stop_runs`)
_RUNNING: set[subprocess.Popen] = set()  # the runs' processes in flight
# What every Slurm job the studies write asks for: a USR1 five minutes before the time limit to the batch
# shell, which has exec'd launch.sh, so every rank checkpoints and the job is requeued (launch.sh), and
# the requeued job's log appended to its first one.
SLURM_REQUEUE = ("--signal=B:USR1@300", "--requeue", "--open-mode=append")
# The naming rule of a study's runs, in one place: a stable run (a chain's first) is VARIANT-SIZE-sSEED, its
# cooldown branch from step S the same name with -bS; a chain is named after its stable run.
RUN_NAME = re.compile(r"^(?P<variant>.+?)-(?P<size>[^-]+)-s(?P<seed>\d+)(?:-b(?P<branch>\d+))?$")


def run_name(variant: str, size: str, seed: int | None = None, branch_step: int | None = None) -> str:
    """A run's name (RUN_NAME's rule); without a seed, the prefix every seed's chain of (variant, size)
    shares, as `isoflop --chains` takes it."""
    name = f"{variant}-{size}" if seed is None else f"{variant}-{size}-s{seed}"
    return name if branch_step is None else f"{name}-b{branch_step}"


def chain_name(run: str) -> str:
    """The chain a run belongs to, its stable run's name: a branch's name less its -bSTEP (a name outside
    the rule is its own chain)."""
    m = RUN_NAME.match(run)
    return run_name(m["variant"], m["size"], int(m["seed"])) if m and m["branch"] else run


def write_array_script(script: Path, job_name: str, arg_lines: list[str], args_file: Path, what: str) -> None:
    """A Slurm array job, one task per line of `args_file` (training arguments for `launch.sh --slurm`),
    which checkpoints and requeues itself near its time limit."""
    args_file.write_text("\n".join(arg_lines) + "\n")
    out = script.parent.resolve()
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --array=0-{len(arg_lines) - 1}
#SBATCH --output={out}/runs/slurm-%A_%a.out
{chr(10).join("#SBATCH " + o for o in SLURM_REQUEUE)}
# Adjust --nodes/--gpus-per-node/--time for your cluster. Each array task trains one {what}; near its
# time limit it checkpoints and requeues itself, and the requeued task resumes (launch.sh).
set -euo pipefail
cd {REPO_ROOT}
ARGS=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {args_file.resolve()})
eval "set -- $ARGS"
exec ./launch.sh --slurm -- "$@"
""")


def tracker_overrides(recipe: str, overrides: list[str], group: str) -> list[str]:
    """A study's runs as one group in the trackers its recipe asks for: `group` (the study) where the
    recipe sets none. Each run is named after its cell already (`name=CELL`, the trackers' default name)."""
    logging = load_recipe(recipe, overrides).logging
    return [
        f"logging.{key}.group={group}"
        for key in ("wandb", "mlflow")
        if getattr(logging, key) is not None and not getattr(logging, key).get("group")
    ]


def train_once(
    train_args: list[str], run_dir: Path, record: dict, threads: int | None = None, log: Path | None = None
) -> bool:
    """Train one run as its own process and, when it finishes, mark `run_dir` done with the wall and CPU
    seconds of every process it took (resumes included; ATTEMPTS) and `record`; False when it failed or
    the study is stopping (a re-run resumes it). `threads`: its OMP threads;
    `log`: a file its output is appended to (default: this process's output). Should this process die, the
    run saves a checkpoint and stops (pretrain/orphan.py) rather than train on unrecorded."""
    if _STOPPING.is_set():
        return False
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    env[LAUNCHER_ENV] = f"{socket.gethostname()} {os.getpid()}"
    start = time.time()
    with open(log, "a") if log else contextlib.nullcontext() as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pretrain.train", *train_args],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
        _RUNNING.add(proc)
        if _STOPPING.is_set():  # the study was stopped while this run started
            proc.send_signal(signal.SIGTERM)
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time, even with others beside it
        finally:
            _RUNNING.discard(proc)
    proc.returncode = os.waitstatus_to_exitcode(status)
    spent = {"seconds": time.time() - start, "cpu_seconds": usage.ru_utime + usage.ru_stime}
    append_row(run_dir / ATTEMPTS, {**spent, "exit_code": proc.returncode})
    if proc.returncode != 0 or not reached_its_end(run_dir):
        return False
    processes = read_rows(run_dir / ATTEMPTS)
    total = {k: sum(p[k] for p in processes) for k in spent}
    (run_dir / DONE).write_text(json.dumps({**total, "processes": len(processes), **record}))
    return True


def reached_its_end(run_dir: Path) -> bool:
    """Whether the run logged its last step: one stopped by a signal (SIGTERM from its study, a
    preemption, its launcher gone) exits 0 after its checkpoint, and is not finished."""
    logged = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r["step"] for r in logged if isinstance(r.get("step"), int)]
    return bool(steps) and max(steps) >= load_recipe(str(run_dir / "config.yaml"), []).max_steps


def _stop_runs(signum: int, frame: Any) -> None:
    """SIGTERM to a study: no run starts any more, and each run in flight gets SIGTERM (it saves a
    checkpoint and stops: its own path), so the study records its time before it exits."""
    _STOPPING.set()
    for proc in list(_RUNNING):
        proc.send_signal(signal.SIGTERM)


def run_chains(chains: Sequence[Callable[[], list[str]]], jobs: int) -> list[str]:
    """Run each chain (a callable that trains some runs in order and returns the names that failed)
    with up to `jobs` chains at once; the names that failed, over all chains. SIGTERM stops them all
    (`_stop_runs`) and then raises RunStopped."""
    if jobs < 1:
        raise StudyError(f"--jobs {jobs} must be >= 1. Fix: e.g. --jobs 2 on a 2-core machine")
    _STOPPING.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop_runs) if main_thread else None

    def unless_stopping(chain: Callable[[], list[str]]) -> list[str]:
        return [] if _STOPPING.is_set() else chain()  # a stopped study starts no more chains

    try:
        if jobs == 1:
            failed = [name for chain in chains for name in unless_stopping(chain)]
        else:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                failed = [name for names in pool.map(unless_stopping, chains) for name in names]
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if _STOPPING.is_set():
        raise RunStopped(
            "the study was stopped (SIGTERM); its runs in flight saved a checkpoint and their time is recorded. "
            "Fix: re-run the same command to resume"
        )
    return failed


def threads_per_job(jobs: int) -> int | None:
    """OMP threads for each of `jobs` processes side by side (None: one process, leave it alone)."""
    return None if jobs == 1 else max(1, (os.cpu_count() or 1) // jobs)


class RowLog:
    """A JSON-lines file of finished runs' rows (studies/rows.py), or None: no log."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.path) if self.path is not None else []

    def names(self) -> set[str]:
        return {r["run"] for r in self.rows()}

    def append(self, row: dict[str, Any]) -> None:
        if self.path is not None:
            append_row(self.path, row)


def collect_run(run_dir: Path) -> dict[str, Any] | None:
    """One row per finished run: losses (and the validation curve), sizes, tokens, FLOPs (schedule-aware),
    wall and CPU time."""
    run = read_config(run_dir)
    rows = read_metrics(run_dir) if run is not None and (run_dir / "metrics.jsonl").is_file() else []
    if not rows:
        return None
    seq_len = int(run["train"]["seq_len"])
    mcfg = ModelConfig.from_dict(run["model"])  # config.yaml records the resolved model
    train_rows = [r for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    last = train_rows[-1] if train_rows else rows[-1]
    tokens = int(last.get("tokens_seen", 0))
    steps = int(last.get("step", 0))
    tokens_per_step = tokens / steps if steps else 0.0

    def flops_through(step: int) -> float:
        """FLOPs of steps 1..step with the freeze schedule: each step costs the rate of the groups frozen then."""
        bounds = [0] + [b for b in mcfg.schedule_boundaries() if b < step] + [step]
        return sum(
            (b1 - b0) * tokens_per_step * flops_per_token(mcfg, seq_len, step=b0)["train"]
            for b0, b1 in zip(bounds[:-1], bounds[1:])
        )

    counts = param_count(mcfg)
    with torch.device("meta"):
        trainable = sum(p.numel() for p in build_model(mcfg).parameters() if p.requires_grad)
    done = run_dir / DONE
    timing = json.loads(done.read_text()) if done.is_file() else {}
    m = RUN_NAME.match(run_dir.name)
    last_eval = next((r for r in reversed(rows) if r.get("val_loss") is not None), {})
    per_set = {k: v for k, v in last_eval.items() if k.startswith("val_loss/")}
    return {
        "run": run_dir.name,
        "variant": mcfg.variant,
        "size": m.group("size") if m else "custom",
        "seed": run.get("seed"),
        "params": counts["total"],
        "non_embedding_params": counts["non_embedding"],
        "trainable_params": trainable,
        "steps": steps,
        "tokens": tokens,
        "flops": flops_through(steps),
        "final_train_loss": last.get("loss"),
        "final_val_loss": val[-1][1] if val else None,
        "best_val_loss": min(v for _, v in val) if val else None,
        # every validation as [step, FLOPs to that step, loss]: a stable run's curve says what loss its
        # variant reached at each compute, the law-free bound of studies/scaling/profiles.py
        "val_curve": [[s, flops_through(s), v] for s, v in val],
        "wall_seconds": timing.get("seconds"),
        "cpu_seconds": timing.get("cpu_seconds"),
        "finished": done.is_file(),
        "lr": run["optim"]["lr"],
        # where it trained: a grid split across machines (CPU and GPU) names each run's own
        "device": run["train"]["device"],
        "precision": run["train"]["precision"],
        # a loss after a decay to min_lr; a stable-phase (constant-rate) loss is not a budget's loss
        "cooled": run["optim"]["decay"] != "constant",
        "branch_step": int(m.group("branch")) if m and m.group("branch") else None,
        **per_set,
    }


def recollect(rows_path: Path, runs_dir: Path) -> tuple[int, int]:
    """Add to each row the fields `collect_run` records now and the row lacks (e.g. `val_curve`), read
    from its run dir under `runs_dir`; every recorded field stays as it was. Returns (rows given fields,
    rows whose run dir is gone)."""
    if not rows_path.is_file() or not runs_dir.is_dir():
        missing = rows_path if not rows_path.is_file() else runs_dir
        raise StudyError(f"{missing} does not exist. Fix: pass the study's --rows file and its runs/ directory")
    counts = [0, 0]

    def add_fields(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for row in rows:
            fresh = collect_run(runs_dir / row["run"]) if (runs_dir / row["run"]).is_dir() else None
            new = {k: v for k, v in (fresh or {}).items() if k not in row}
            counts[0] += bool(new)
            counts[1] += fresh is None
            out.append({**row, **new})
        return out

    update_rows(rows_path, add_fields)
    return counts[0], counts[1]


def merge_share(
    rows_path: Path, share_path: Path, only: list[str] | None = None, repeats_path: Path | None = None
) -> tuple[list[str], list[str]]:
    """Append to `rows_path` the rows of another machine's share of the grid (`share_path`, that
    machine's copy of the row log) that it lacks, whole chains only: a chain whose last branch (the one
    at its stable run's last step) is missing is left out, so its runs stay with the machine that trains
    the rest of it. `only`: these chains (stable-run names) and no other, e.g. a device check's rows taken
    from a share whose copy also holds the grid's. `repeats_path`: where the taken chains' runs that the
    grid already holds, trained again to the same step, go (a device check where the devices differ, a
    replay where not), once each. Returns (the chains taken, the chains left out)."""
    for path, what in (
        (rows_path, "the grid's row log"),
        (share_path, "the row log the other machine wrote (its --rows)"),
    ):
        if not path.is_file():
            raise StudyError(f"{path} does not exist. Fix: {what}")
    chains: dict[str, list[dict[str, Any]]] = {}
    for row in read_rows(share_path):
        chains.setdefault(chain_name(row["run"]), []).append(row)
    if only is not None:
        if missing := [n for n in only if n not in chains]:
            raise StudyError(f"--chains {','.join(missing)}: not in {share_path}. Fix: stable-run names of its rows")
        chains = {n: chains[n] for n in only}
    taken, left = [], []

    def add(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        have = {r["run"] for r in rows}
        steps = {r["run"]: r.get("steps") for r in rows}
        for name, chain in chains.items():
            new = [r for r in chain if r["run"] not in have]
            stable = next((r for r in chain if r["run"] == name), None)
            if not new:
                continue
            if stable is not None and any(r.get("branch_step") == stable["steps"] for r in chain):
                taken.append(name)
                rows = rows + new
                repeats.extend(r for r in chain if r["run"] in have and r["steps"] == steps[r["run"]])
            else:
                left.append(name)
        return rows

    repeats: list[dict[str, Any]] = []
    update_rows(rows_path, add)
    if repeats_path is not None and repeats:
        update_rows(repeats_path, lambda rows: rows + [r for r in repeats if r not in rows])
    return taken, left
