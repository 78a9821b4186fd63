"""A chaos run: train one run while SIGKILLing every process of it at random moments, some of them
in the middle of a checkpoint write, restarting with `--resume auto` each time; at the end the
loss sequence must equal an uninterrupted run's and every checkpoint directory must be complete.

    python -m studies.chaos --layout zero3 --steps 300 --kills 6 --seed 1 --out runs/chaos
    python -m studies.chaos --layout pipeline --steps 300 --kills 6 --seed 1 --out runs/chaos

Each layout runs on 2 CPU ranks (gloo): `zero3` is 2-way data parallel under ZeRO-3, `pipeline`
is 2 pipeline stages (ZeRO-1). The kill moments come from `--seed` (printed, so a failure can be
replayed): half are at a random step, half wait until a checkpoint directory exists without its
COMPLETE marker (the save is slowed by `PRETRAIN_FAULTS` save_pause_s so the window can be hit)
and kill there. Every rank gets SIGKILL at once, as a node failure or an OOM kill of the job
would. Prints a table and writes OUT/<layout>/chaos.json.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from checkpoint import tag_format
from common.cli import print_error
from common.constants import REPO_ROOT, free_port
from eval.report import markdown_table
from pretrain.metrics import last_step, read_metrics

from .shared import study_parser

RECIPE = "recipes/tiny_cpu.yaml"
LAYOUTS = {
    "zero3": ["parallel.ds_config=zero3"],
    "pipeline": ["parallel.ds_config=pipeline", "parallel.pipeline_stages=2"],
}
SAVE_PAUSE_S = 1.0


@dataclass
class ChaosResult:
    layout: str
    seed: int
    steps: int
    kills: list[dict] = field(default_factory=list)  # {"at_step", "during_save", "tag"}
    restarts: int = 0
    max_abs_loss_diff: float = float("nan")
    equal_steps: int = 0
    incomplete_dirs: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.equal_steps == self.steps and not self.incomplete_dirs and self.max_abs_loss_diff == 0.0


def _overrides(layout: str, steps: int, every: int) -> list[str]:
    return [
        *LAYOUTS[layout],
        f"train.max_steps={steps}",
        f"checkpoint.every_steps={every}",
        "checkpoint.keep_last=2",
        "train.eval_every_steps=0",
        "logging.tensorboard=false",
        "logging.progress_bar='off'",
        "model.variant=standard",
        "train.grad_clip=1.0",
    ]


def _start(run_dir: Path, over: list[str], log, pause: bool) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "pretrain.train", "--recipe", RECIPE, "--run-dir", str(run_dir), "--resume", "auto"]
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    if pause:
        env["PRETRAIN_FAULTS"] = json.dumps({"save_pause_s": SAVE_PAUSE_S})
    return [
        subprocess.Popen(
            [*cmd, *over],
            cwd=REPO_ROOT,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in range(2)
    ]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def step_losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(run_dir) if "loss" in r}


def compare_losses(ref: dict[int, float], got: dict[int, float], steps: int) -> tuple[int, float]:
    """(the steps 1..`steps` whose loss equals the reference's, the largest difference: inf unless
    both runs logged every step)."""
    common = [s for s in range(1, steps + 1) if s in got and s in ref]
    diff = max(abs(got[s] - ref[s]) for s in common) if len(common) == steps else float("inf")
    return sum(got[s] == ref[s] for s in common), diff


def incomplete_dirs(run_dir: Path) -> list[str]:
    """The run's checkpoint directories without their COMPLETE marker."""
    root = tag_format.ckpt_root(run_dir)
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not tag_format.is_complete(d))


def last_logged_step(run_dir: Path, since: float) -> int:
    """The last step logged by a process started at `since` (an older metrics file says nothing)."""
    m = run_dir / "metrics.jsonl"
    return last_step(run_dir) if m.is_file() and m.stat().st_mtime >= since else 0


def _saving(run_dir: Path, since: float) -> Path | None:
    """A tag dir written since `since` that has no COMPLETE marker yet: a checkpoint is being written
    (a partial dir left by an earlier kill is older, and is not one)."""
    root = tag_format.ckpt_root(run_dir)
    for d in root.iterdir() if root.is_dir() else ():
        try:
            fresh = d.stat().st_mtime >= since
        except FileNotFoundError:
            continue
        if tag_format.TAG_RE.match(d.name) and fresh and not (d / tag_format.COMPLETE).exists():
            return d
    return None


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.time() + timeout
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.time()))
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise RuntimeError(f"a rank exited with {bad}; see the log")


def chaos_run(
    layout: str,
    steps: int,
    kills: int,
    seed: int,
    out: Path,
    every: int = 5,
    timeout: float = 900,
    say=print,
    background: bool = False,
) -> ChaosResult:
    """Reference run, then the killed-and-resumed run; compare their loss sequences. `background`:
    checkpoints are written on the writer thread (`checkpoint.background`), so a mid-save kill
    strikes while training goes on."""
    t0 = time.time()
    rng = random.Random(seed)
    out = Path(out) / layout
    out.mkdir(parents=True, exist_ok=True)
    over = [*_overrides(layout, steps, every), f"checkpoint.background={str(background).lower()}"]
    res = ChaosResult(layout, seed, steps)
    say(f"[chaos] layout {layout}, {steps} steps, {kills} kills, seed {seed} (replay: --seed {seed})")
    for d in (out / "reference", out / "chaos"):
        shutil.rmtree(d, ignore_errors=True)
    with open(out / "reference.log", "w") as log:
        _wait_all(_start(out / "reference", over, log, pause=False), timeout)
    ref = step_losses(out / "reference")
    plan = sorted(rng.sample(range(2, steps - 1), kills))  # steps after which to strike
    mid_save = set(rng.sample(range(kills), kills // 2))  # these wait for a save in flight
    run = out / "chaos"
    with open(out / "chaos.log", "w") as log:
        for i, at in enumerate(plan):
            since = time.time() - 0.01
            procs = _start(run, over, log, pause=i in mid_save)
            res.restarts += 1
            deadline = time.time() + timeout
            hit = None
            while time.time() < deadline and all(p.poll() is None for p in procs):
                if last_logged_step(run, since) >= at and (
                    i not in mid_save or (hit := _saving(run, since)) is not None
                ):
                    break
                time.sleep(0.02)
            if any(p.poll() is not None for p in procs):
                _kill(procs)
                raise RuntimeError(f"the run ended before kill {i + 1} (at step {at}); see {out / 'chaos.log'}")
            step = last_logged_step(run, since)
            _kill(procs)
            res.kills.append({"at_step": step, "during_save": hit is not None, "tag": hit.name if hit else None})
            say(
                f"[chaos] kill {i + 1}/{kills}: SIGKILL to both ranks after step {step}"
                + (f", while {hit.name} was being written" if hit else "")
            )
        _wait_all(_start(run, over, log, pause=False), timeout)
        res.restarts += 1
    res.equal_steps, res.max_abs_loss_diff = compare_losses(ref, step_losses(run), steps)
    res.incomplete_dirs = incomplete_dirs(run)
    res.seconds = round(time.time() - t0, 1)
    (out / "chaos.json").write_text(json.dumps({**asdict(res), "ok": res.ok}, indent=1) + "\n")
    return res


def table(results: list[ChaosResult]) -> str:
    header = ["layout", "steps", "kills (mid-save)", "restarts", "losses equal to the uninterrupted run"]
    header += ["max abs diff", "incomplete checkpoint dirs", "seed", "wall"]
    rows = []
    for r in results:
        kills = f"{len(r.kills)} ({sum(k['during_save'] for k in r.kills)})"
        row = [r.layout, r.steps, kills, r.restarts, f"{r.equal_steps}/{r.steps}", f"{r.max_abs_loss_diff:.2e}"]
        rows.append(row + [len(r.incomplete_dirs), r.seed, f"{r.seconds:.0f} s"])
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.chaos", __doc__)
    ap.add_argument("--layout", choices=[*LAYOUTS, "all"], default="all")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--seed", type=int, help="kill moments (default: random, printed)")
    ap.add_argument("--out", default="runs/chaos")
    ap.add_argument("--background-saves", action="store_true", help="checkpoint.background=true")
    a = ap.parse_args(argv)
    if a.kills < 1 or a.steps < a.kills + 3:
        print_error(f"--steps {a.steps} leaves no room for {a.kills} kills. Fix: --steps >= --kills + 3")
        return 2
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    layouts = list(LAYOUTS) if a.layout == "all" else [a.layout]
    try:
        results = [
            chaos_run(lay, a.steps, a.kills, seed, Path(a.out), a.every, background=a.background_saves)
            for lay in layouts
        ]
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print_error(f"{e} (seed {seed}). Fix: read the run's log under {a.out}; replay with --seed {seed}")
        return 1
    print(table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
