"""The long chaos run: one run that heals itself from everything a cluster does to it.

    python -m studies.chaos_long --steps 500 --seed 1 --out runs/chaos_long      # needs root (a tmpfs)

4 CPU ranks (gloo, ZeRO-3) train the tiny model on shards of `data/sample` read over HTTP from a
loopback aiohttp server, with a warmup-stable-decay schedule and background checkpoints, launched by
`launch.sh --max-restarts`, the run dir on a tmpfs of its own. At steps drawn from `--seed`, one after
another:
- a rank is SIGKILLed (three times): launch.sh stops the other ranks and restarts the job;
- the launcher is SIGKILLed: every rank notices, checkpoints and exits; the study then runs the same
  command again, as a scheduler requeues a job whose batch script died;
- the data server goes down for longer than the loader's retries: the job stops, launch.sh restarts it,
  and the server is back by then;
- the disk fills up during a save: the save fails on every rank, the job stops, launch.sh restarts it,
  and the space is freed by then.
Every other recovery is `--max-restarts`. At the end: the losses against an uninterrupted run of the
same command, processes left over, and checkpoint directories without their COMPLETE marker.
Writes OUT/chaos_long.json and prints a table (docs/RELIABILITY.md reports it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.cli import print_error
from common.constants import REPO_ROOT
from eval.report import markdown_table

from .chaos import compare_losses, incomplete_dirs, last_logged_step, step_losses
from .shared import study_parser
from .static_server import http_server

RANKS = 4
EVERY = 25  # checkpoint every N steps


@dataclass
class LongChaosResult:
    steps: int
    seed: int
    faults: list[dict] = field(default_factory=list)  # {"kind", "at_step", ...}
    launches: int = 0  # launch.sh invocations (1 + one per launcher kill)
    restarts: int = 0  # relaunches by launch.sh --max-restarts (RUN/restarts.jsonl)
    equal_steps: int = 0
    max_abs_loss_diff: float = float("inf")
    incomplete_dirs: list[str] = field(default_factory=list)
    leftover_processes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.equal_steps == self.steps
            and self.max_abs_loss_diff == 0.0
            and not self.incomplete_dirs
            and not self.leftover_processes
        )


def processes_mentioning(text: str) -> dict[int, str]:
    """pid -> command line of every live process whose command line contains `text`."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
            except OSError:
                continue
            if text in cmd and "zombie" not in state:
                found[int(d.name)] = cmd
    return found


def prepare_data(out: Path) -> Path:
    """A tokenizer and shards of data/sample/train.jsonl under OUT/data (kept across runs)."""
    data = out / "data"
    if not (data / "train" / "manifest.json").is_file():
        sample = REPO_ROOT / "data" / "sample" / "train.jsonl"
        py = [sys.executable, "-m"]
        subprocess.run([*py, "data_pipeline.tokenizer", "train", "--input", str(sample), "--vocab-size", "2000",
                        "--out", str(data / "tok")], cwd=REPO_ROOT, check=True)  # fmt: skip
        subprocess.run([*py, "data_pipeline.prepare", "--source", str(sample), "--tokenizer", str(data / "tok"),
                        "--out", str(data / "train")], cwd=REPO_ROOT, check=True)  # fmt: skip
    return data


def launch_cmd(run: Path, url: str, cache: Path, steps: int) -> list[str]:
    return [
        "./launch.sh", "--cpu", str(RANKS), "--max-restarts", "8", "--restart-backoff", "1", "--",
        "--recipe", "recipes/tiny_cpu.yaml", "--run-dir", str(run),
        "parallel.ds_config=zero3", "parallel.timeout_s=120", "model.variant=standard",
        f"data.source={url}/train", f"data.cache_dir={cache}", "data.cache_block_kb=4", "data.cache_max_gb=0.0002",
        "data.retries=2", "data.retry_backoff_s=1",
        "train.seq_len=64", "train.micro_batch_sequences=2", f"train.max_steps={steps}", "train.eval_every_steps=0",
        "optim.decay=wsd", "optim.decay_fraction=0.2",
        f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=3", "checkpoint.background=true",
        "checkpoint.every_minutes=0", "logging.tensorboard=false",
    ]  # fmt: skip


def _launch(cmd: list[str], log) -> subprocess.Popen:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT", "MASTER_ADDR")
    env = dict({k: v for k, v in os.environ.items() if k not in drop}, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _ranks(run: Path) -> list[int]:
    return sorted(p for p, c in processes_mentioning(str(run)).items() if "--local_rank" in c)


def _restarts(run: Path) -> int:
    f = run / "restarts.jsonl"
    return len(f.read_text().splitlines()) if f.is_file() else 0


def _resize(where: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True, capture_output=True)


def plan_faults(steps: int, rng: random.Random) -> list[tuple[str, int]]:
    kinds = ["rank", "rank", "rank", "launcher", "outage", "disk"]
    rng.shuffle(kinds)
    gap = (steps - 60) // len(kinds)
    return [(k, 30 + i * gap + rng.randrange(gap // 2)) for i, k in enumerate(kinds)]


def long_chaos_run(steps: int, seed: int, out: Path, timeout: float = 3600, say=print) -> LongChaosResult:
    t0 = time.time()
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    res = LongChaosResult(steps, seed)
    data = prepare_data(out)
    server = http_server(data, log=out / "server.log")
    fs = out / "fs"
    subprocess.run(["umount", str(fs)], capture_output=True)
    fs.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={512 << 20}", "tmpfs", str(fs)], check=True, capture_output=True
    )
    run = fs / "run"
    try:
        say(f"[chaos-long] {steps} steps, {RANKS} ranks, seed {seed}: the uninterrupted run")
        with open(out / "reference.log", "w") as log:
            ref_cmd = launch_cmd(out / "reference", f"http://127.0.0.1:{server.port}", out / "cache-ref", steps)
            if _launch(ref_cmd, log).wait(timeout) != 0:
                raise RuntimeError(f"the uninterrupted run failed; see {out / 'reference.log'}")
        cmd = launch_cmd(run, f"http://127.0.0.1:{server.port}", out / "cache", steps)
        faults = plan_faults(steps, rng)
        say(f"[chaos-long] the chaos run; faults: {faults}")
        with open(out / "chaos.log", "w") as log:
            proc, res.launches = _launch(cmd, log), 1
            deadline = time.time() + timeout
            for kind, at in faults:
                since = time.time() - 0.01
                # a step logged since the last fault (a recovery may have gone past `at`), every rank up
                while last_logged_step(run, since) < at or len(ranks := _ranks(run)) < RANKS:
                    if proc.poll() is not None or time.time() > deadline:
                        raise RuntimeError(
                            f"the run ended before the {kind} fault at step {at}; see {out / 'chaos.log'}"
                        )
                    time.sleep(0.05)
                step, before = last_logged_step(run, since), _restarts(run)
                fault = {"kind": kind, "at_step": step}
                if kind == "rank":
                    victim = rng.choice(ranks)
                    os.kill(victim, signal.SIGKILL)
                    fault["pid"] = victim
                elif kind == "launcher":
                    os.kill(proc.pid, signal.SIGKILL)  # the shell only: the ranks must notice by themselves
                    proc.wait()
                    while processes_mentioning(str(run)) and time.time() < deadline:
                        time.sleep(0.2)
                    proc = _launch(cmd, log)  # what a scheduler's requeue does
                    res.launches += 1
                elif kind == "outage":
                    server.stop()
                elif kind == "disk":
                    st = os.statvfs(fs)
                    _resize(fs, (st.f_blocks - st.f_bfree) * st.f_frsize + (256 << 10))  # room for the metrics only
                if kind in ("rank", "outage", "disk"):  # launch.sh notices the failure and restarts the job
                    while _restarts(run) == before:
                        if proc.poll() is not None or time.time() > deadline:
                            raise RuntimeError(f"launch.sh did not restart the job after the {kind} fault")
                        time.sleep(0.05)
                    fault["job_failed_after_step"] = json.loads((run / "restarts.jsonl").read_text().splitlines()[-1])[
                        "after_step"
                    ]
                if kind == "outage":
                    server.start()
                elif kind == "disk":
                    _resize(fs, 512 << 20)
                fault["seconds"] = round(time.time() - since, 1)
                res.faults.append(fault)
                say(f"[chaos-long] {fault}")
            if proc.wait(max(1.0, deadline - time.time())) != 0:
                raise RuntimeError(f"the chaos run ended with exit {proc.returncode}; see {out / 'chaos.log'}")
        res.equal_steps, res.max_abs_loss_diff = compare_losses(step_losses(out / "reference"), step_losses(run), steps)
        res.restarts = _restarts(run)
        res.incomplete_dirs = incomplete_dirs(run)
        time.sleep(2)
        res.leftover_processes = sorted(processes_mentioning(str(run)).values())
    finally:
        server.stop()
        if (run / "metrics.jsonl").is_file():
            (out / "chaos-run").mkdir(exist_ok=True)
            for name in ("metrics.jsonl", "restarts.jsonl"):
                if (run / name).is_file():
                    (out / "chaos-run" / name).write_bytes((run / name).read_bytes())
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)
    res.seconds = round(time.time() - t0, 1)
    (out / "chaos_long.json").write_text(json.dumps({**asdict(res), "ok": res.ok}, indent=1) + "\n")
    return res


def table(r: LongChaosResult) -> str:
    kinds = ", ".join(f"{f['kind']}@{f['at_step']}" for f in r.faults)
    header = ["steps", "ranks", "faults (kind@step)", "launches", "restarts by launch.sh", "losses equal"]
    header += ["max abs diff", "incomplete checkpoint dirs", "leftover processes", "seed", "wall"]
    row = [r.steps, RANKS, kinds, r.launches, r.restarts, f"{r.equal_steps}/{r.steps}", f"{r.max_abs_loss_diff:.2e}"]
    row += [len(r.incomplete_dirs), len(r.leftover_processes), r.seed, f"{r.seconds:.0f} s"]
    return markdown_table(header, [row])


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.chaos_long", __doc__)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, help="fault steps and victims (default: random, printed)")
    ap.add_argument("--out", default="runs/chaos_long")
    a = ap.parse_args(argv)
    if a.steps < 120:
        print_error(f"--steps {a.steps} leaves no room for six faults. Fix: --steps >= 120")
        return 2
    if os.geteuid() != 0:
        print_error("the run dir's tmpfs needs root (mount). Fix: run as root, as CI does")
        return 2
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    try:
        res = long_chaos_run(a.steps, seed, Path(a.out))
    except (RuntimeError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print_error(f"{e} (seed {seed}). Fix: read the logs under {a.out}; replay with --seed {seed}")
        return 1
    print(table(res))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
