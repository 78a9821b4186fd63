"""Pretraining under the DeepSpeed engine.

    python -m pretrain.train --recipe recipes/tiny_cpu.yaml [--dry-run] [--resume auto|never|PATH]
                             [--run-dir DIR] [section.key=value ...]

Runs as one plain process (world size 1; the process group is set up here with gloo or
nccl) or under `deepspeed` / `launch.sh` / torchrun. `train(recipe, overrides)` is the
same thing as a Python function. A run's steps, each in its own module, are docs/ARCHITECTURE.md's.
"""

from __future__ import annotations

import argparse
import atexit
import os
from pathlib import Path

import torch

from common.cli import STOPPED, CliParser, exit_code, print_error
from common.errors import DataError, RankFailure, RunStopped, UserError

from . import faults, orphan, rendezvous
from .bounds import CollectiveBounds
from .config import ParallelConfig, RunConfig, load_recipe
from .distributed import (
    SOLO_ENV,
    check_interface,
    collective_failure,
    comm_failure,
    exit_process,
    init_distributed,
    pick_device,
    rank_failure_message,
    shutdown_distributed,
    watch_collectives,
)
from .dry_run import dry_run, print_config
from .eval_tasks import task_hooks
from .hooks import TrainHook, check_hooks
from .loop import RunResult
from .parallelize import residency
from .preemption import stop_on_signals
from .run_dir import default_run_dir
from .setup import build_run
from .trackers import check_trackers

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def train(
    recipe: str | Path | dict | None = None,
    overrides=None,
    run_dir: str | Path | None = None,
    resume: str | None = "auto",
    stop_after_steps: int | None = None,
    overwrite: bool = False,
    hooks: list[TrainHook] | None = None,
) -> RunResult:
    """Train (or continue) a run; returns the per-step losses. `stop_after_steps` ends the
    process's loop early at that step without a final checkpoint (for tests). A run dir that
    holds another run is refused unless resumed or `overwrite` (pretrain/run_dir.py). `hooks`:
    callables (model, step) -> metrics run at the validation cadence (pretrain/hooks.py)."""
    cfg = None
    try:  # what a rank refuses before it meets the others, it tells them (pretrain/rendezvous.py)
        cfg = load_recipe(recipe, overrides)
        hooks = check_inputs(cfg, hooks)
        device = pick_device(cfg.train.device)
        check_interface()
    except (UserError, OSError) as e:
        rendezvous.refused(str(e), (cfg.parallel if cfg else ParallelConfig()).rendezvous_timeout_s)
        raise
    bounds = CollectiveBounds(cfg.parallel)
    saved_env = {k: os.environ.get(k) for k in ENV_KEYS}
    plain = "RANK" not in os.environ
    if plain:  # a plain process: world size 1 (the environment is restored on return)
        os.environ.update(SOLO_ENV)
    if init_distributed(device, bounds.now_s, bounds.rendezvous_s):
        # ZeRO-3 processes abort at exit unless the process group is destroyed. It is kept
        # until then (DeepSpeed caches its groups), so train() can be called again in-process.
        atexit.register(shutdown_distributed)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    # NCCL reports a dead or hung peer on its watchdog thread, not in this one: a thread of ours turns it
    # into the same message (gloo raises here, below); a CPU test injects the report (pretrain/faults.py)
    probe = faults.comm_probe() or (comm_failure if device.type == "cuda" else None)
    watching = watch_collectives(run_dir, bounds.describe, probe) if probe else None
    try:
        return _train(cfg, device, run_dir, resume, stop_after_steps, overwrite, hooks, bounds)
    except Exception as e:
        if isinstance(e, (UserError, RunStopped)) or not collective_failure(e):
            raise
        raise RankFailure(rank_failure_message(e, bounds.describe(), run_dir)) from e
    finally:
        if watching is not None:
            watching.set()
        if plain:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _train(
    cfg: RunConfig,
    device: torch.device,
    run_dir: Path,
    resume,
    stop_after_steps,
    overwrite,
    hooks: list[TrainHook],
    bounds: CollectiveBounds,
) -> RunResult:
    run = build_run(cfg, device, run_dir, resume, overwrite, hooks, bounds)
    point, logger = run.ctx.point, run.logger
    for note in point.notes:
        logger.message(note)
    if point.tag_dir is not None:
        logger.message(f"resumed from {point.tag_dir} at step {point.step}")
    logger.message(f"layout: {run.ctx.layout.describe()}")
    logger.message(residency(run.model_engine.model, device))
    engine = run.model_engine
    logger.message(
        f"activation checkpointing: {engine.checkpointing} ({engine.checkpointing_reason}); "
        f"memory estimate {engine.memory_estimate_gib:.2f} GiB per rank (pretrain/memory.py)"
    )
    if logger.peak[0]:
        logger.message(f"MFU peak: {logger.peak[0]:.1f} TFLOP/s per device ({logger.peak[1]})")
    try:
        with stop_on_signals(cfg.checkpoint.save_on_signal) as stop:
            result = run.loop.run(stop, stop_after_steps)
    except DataError as e:  # the data was readable at the start: it went away mid-run (a shard server outage)
        raise RunStopped(str(e)) from e
    finally:
        logger.close()
    run.model_engine.engine.destroy()
    return result


def check_inputs(cfg, hooks: list[TrainHook] | None = None) -> list[TrainHook]:
    """What a launch checks before any work, beyond the recipe's own validation: the trackers' settings
    and the training-time evaluations (`eval.tasks`, with the tokenizer they need); `--dry-run` runs it
    too, so a queued job is refused when it is submitted, not when it starts."""
    check_trackers(cfg.logging)
    return check_hooks([*(hooks or []), *task_hooks(cfg)], cfg.train.eval_every_steps, cfg.parallel.pipeline_stages)


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m pretrain.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True, help="recipes/X.yaml")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the plan; train nothing")
    ap.add_argument("--print-config", action="store_true", help="print the resolved recipe (YAML); train nothing")
    ap.add_argument("--print-run-dir", action="store_true", help="print the run directory; train nothing")
    ap.add_argument("--world-size", type=int, default=None, help="world size for --dry-run (default: $WORLD_SIZE or 1)")
    ap.add_argument(
        "--without-data",
        action="store_true",
        help="--dry-run without reading the data (a plan made away from it; vocabulary: model.vocab_size, else the preset's)",
    )
    ap.add_argument("--resume", default="auto", help="auto (latest complete checkpoint), never, or a path")
    ap.add_argument("--run-dir", default=None, help="default: runs/<name>")
    ap.add_argument("--overwrite", action="store_true", help="replace a different run already in the run dir")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_intermixed_args(argv)
    if args.without_data and not args.dry_run:
        ap.error("--without-data plans without the data: it goes with --dry-run")
    orphan.stop_when_launcher_dies()  # a rank whose launcher died saves a checkpoint and stops
    try:
        if args.print_config:
            print_config(load_recipe(args.recipe, args.overrides))
            return 0
        if args.print_run_dir:  # launch.sh --max-restarts: where the run records its restarts
            print(args.run_dir or default_run_dir(load_recipe(args.recipe, args.overrides)))
            return 0
        if args.dry_run:
            cfg = load_recipe(args.recipe, args.overrides)
            check_inputs(cfg)
            dry_run(cfg, args.world_size or int(os.environ.get("WORLD_SIZE", 1)), data=not args.without_data)
            return 0
        res = train(args.recipe, args.overrides, run_dir=args.run_dir, resume=args.resume, overwrite=args.overwrite)
        shutdown_distributed(finished=True, run_dir=res.run_dir)
    except (UserError, RunStopped, OSError) as e:
        print_error(e)
        rendezvous.linger()  # a refusal before the run began: every rank learns it before this one goes
        if isinstance(e, RankFailure):
            os._exit(STOPPED)  # a dead peer can make process-group teardown hang
        return exit_code(e)
    if int(os.environ.get("RANK", 0)) == 0:
        last = res.losses[max(res.losses)] if res.losses else float("nan")
        print(
            f"done: step {res.final_step}, tokens {res.tokens_seen:,}, last loss {last:.4f}, "
            f"checkpoint {res.last_checkpoint}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    exit_process(main())
