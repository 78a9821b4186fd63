"""The one place a run is put together: from the recipe, in a fixed order, the layout, the resume point,
the data (which sizes the model), the model engine, the training loader, the logger, the checkpointer, the
callbacks (pretrain/callbacks.py) and the loop. Every check a user's input can fail runs before the first
expensive step (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import RecipeError
from model.mfu import peak_tflops

from . import faults, loaders
from .agreement import agree, agree_on_data, write_code
from .bounds import CollectiveBounds
from .callbacks import Callback
from .config import RunConfig
from .context import RunContext
from .engine import ModelEngine
from .engine_checkpoint import Checkpointer
from .hooks import TrainHook
from .layout import plan_layout
from .loop import TrainingLoop
from .metrics import Logger
from .nan_guard import NanGuard
from .periodic_save import PeriodicSave
from .profiling import StepProfiler
from .resume import agreed_resume_point, check_fits, check_layout
from .run_dir import check_run_dir, resolved_config, write_config
from .schedule_change import check_schedule
from .task_model import model_config
from .trackers import build_trackers
from .validation import Validation


@dataclass
class Run:
    """What `build_run` made: the context every component was built from, and the components."""

    ctx: RunContext
    model_engine: ModelEngine
    logger: Logger
    loop: TrainingLoop


def build_logger(ctx: RunContext) -> Logger:
    """Rank 0's record (metrics.jsonl cut back to the resume step, the console) and the peak its MFU
    divides by (model/mfu.py)."""
    start = ctx.point.step
    logger = Logger(ctx.run_dir, ctx.rank == 0, ctx.cfg.logging.progress_bar, ctx.cfg.max_steps, start)
    if ctx.point.tag_dir is not None:
        logger.truncate_after(start)
    logger.peak = peak_tflops(ctx.cfg.logging.peak_tflops, ctx.cfg.logging.measure_peak, ctx.device)
    return logger


def start_trackers(ctx: RunContext) -> list[Callback]:
    """Rank 0's trackers (pretrain/trackers.py); every rank takes part: a tracker that did not start stops
    every rank with its line, not rank 0 alone while the others wait in their first collective."""
    trackers, refused = [], [None]
    if ctx.rank == 0:
        try:
            trackers = build_trackers(ctx.cfg.logging, ctx.run_dir, ctx.cfg.name, ctx.resolved, ctx.point.step)
        except RecipeError as e:
            refused = [str(e)]
    dist.broadcast_object_list(refused, src=0)
    if refused[0] is not None:
        raise RecipeError(refused[0])
    return trackers


def build_run(
    cfg: RunConfig,
    device: torch.device,
    run_dir: Path,
    resume,
    overwrite: bool,
    hooks: list[TrainHook],
    bounds: CollectiveBounds,
) -> Run:
    """Build this rank's run, every rank in step; the process group is up. First of all, every rank agrees on
    the run (pretrain/agreement.py): nothing is read or written before the ranks know they run the same."""
    rank, world = dist.get_rank(), dist.get_world_size()
    agreed = agree(cfg, device, rank, world)
    torch.manual_seed(cfg.seed)
    point = agreed_resume_point(cfg, run_dir, resume, overwrite, rank, world)
    layout = plan_layout(cfg, world)
    probe = loaders.check_data(cfg, layout.data_parallel, run_dir)
    agree_on_data(probe, world)
    mcfg = model_config(cfg, getattr(probe, "vocab_size", None))
    layout.check_layers(mcfg.num_layers)
    check_fits(point, cfg, mcfg, getattr(probe, "tokenizer_id", None))
    schedule_change = check_schedule(point, cfg)  # refused unless allowed, else said in the log
    if schedule_change:
        point.notes.append(schedule_change)
    del probe
    resolved = resolved_config(cfg, mcfg)
    if rank == 0 or not overwrite:  # same answer on every rank; only rank 0 clears for --overwrite
        check_run_dir(run_dir, resolved, resume, overwrite and rank == 0)
    dist.barrier()
    check_layout(point, layout, run_dir)
    ctx = RunContext(cfg, mcfg, layout, device, run_dir, point, rank, world, resolved)

    model_engine = ModelEngine.from_context(ctx)
    if rank == 0:  # the run dir is this run's once its engine stands
        write_config(run_dir, resolved)
        write_code(run_dir, agreed)
    loader = loaders.loader(cfg, "train", model_engine.dp_rank, layout.data_parallel, verify_record=run_dir)
    if point.tag_dir is not None:  # at the resume point's position
        loader.load_state_dict(point.state["loader"])
    logger = build_logger(ctx)
    ck = cfg.checkpoint
    checkpointer = Checkpointer(run_dir, ck.keep_last, ck.background, ck.timeout_s, bounds)
    tc = cfg.train
    guard = NanGuard(
        tc.nan_policy, tc.max_nan_skips, cfg.global_batch_size, run_dir if rank == 0 else None, logger.message
    )
    saving = PeriodicSave(ck.every_steps, ck.every_minutes, rank)
    callbacks = [guard, saving, *start_trackers(ctx), *faults.step_killer(run_dir, rank)]  # faults: if asked
    if StepProfiler.wanted(cfg.profile, rank):
        callbacks.insert(0, StepProfiler(cfg.profile, run_dir, rank, device, logger.message))
    if cfg.train.eval_every_steps:
        callbacks.append(Validation(ctx, model_engine, getattr(loader, "tokenizer_id", None), hooks))
    loop = TrainingLoop(ctx, model_engine, loader, logger, checkpointer, callbacks, bounds)
    return Run(ctx, model_engine, logger, loop)
