"""The process group: which device a rank uses, starting and ending torch.distributed, and
turning a failed collective (a peer died or hangs) into a message that says what to do."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from checkpoint import tag_format
from common.deepspeed_import import import_deepspeed
from common.errors import RecipeError

# NCCL's failure behaviour, stated rather than left to torch's defaults (launch.sh exports the same;
# values already in the environment win): a failed or timed-out collective (parallel.timeout_s)
# makes the watchdog tear the rank down instead of leaving it hanging; docs/RELIABILITY.md.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_BLOCKING_WAIT": "0"}


def pick_device(want: str) -> torch.device:
    """`train.device` (auto | cpu | cuda) -> this rank's device."""
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise RecipeError("train.device=cuda but no CUDA device is visible. Fix: train.device=cpu")
    if want == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if want == "cuda":
        return torch.device("cuda", cuda_index(torch.cuda.device_count()))
    return torch.device("cpu")


def cuda_index(visible: int) -> int:
    """This rank's GPU among the `visible` ones: cuda:0 when each process sees one (srun --gpus-per-task) or
    for a plain process (no launcher), else cuda:LOCAL_RANK, one process per GPU. A node whose process count differs from its GPU count
    (a second process on a GPU, or GPUs left idle, as `--ntasks-per-node=1` on an 8-GPU node would) is
    refused with the numbers, before anything is built."""
    if visible == 1 or "RANK" not in os.environ:  # one GPU each, or a plain process: the first visible GPU
        return 0
    local = int(os.environ.get("LOCAL_RANK", 0))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
    if local >= visible or per_node != visible:
        host = os.environ.get("HOSTNAME") or os.uname().nodename
        raise RecipeError(
            f"rank {os.environ.get('RANK', 0)} on {host}: {per_node} processes on this node (LOCAL_RANK {local}) "
            f"but {visible} GPUs visible, so a GPU would be shared or left idle. Fix: one process per GPU "
            f"(launch.sh --gpus {visible}; under Slurm --ntasks-per-node={visible} with --gpus-per-node={visible}), "
            "or CUDA_VISIBLE_DEVICES naming the GPUs to use"
        )
    return local


def init_distributed(device: torch.device, timeout_s: float | None = None) -> bool:
    """Initialise torch.distributed through DeepSpeed; returns True when this call created it.
    `timeout_s` bounds every collective (a dead or hung peer ends the run instead of hanging it)."""
    deepspeed = import_deepspeed()

    if dist.is_available() and dist.is_initialized():
        return False
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if device.type == "cpu":
        # DeepSpeed's CPU backend would JIT-compile a shared-memory all-reduce op on first use
        # (minutes on a small machine); gloo's own all-reduce is used instead.
        from deepspeed.accelerator import get_accelerator  # deferred: heavy (deepspeed)

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False
    if device.type == "cuda":
        torch.cuda.set_device(device)
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
    kw = {}
    if timeout_s:
        kw["timeout"] = datetime.timedelta(seconds=timeout_s)
        # DeepSpeed creates its data/pipeline/ZeRO groups with `new_group(ranks)`, which takes
        # torch's module-level default (30 min for gloo), not the world group's timeout: without
        # this, a peer that hangs inside a sub-group collective holds this rank for 30 minutes.
        c10d.default_pg_timeout = kw["timeout"]
        if hasattr(c10d, "default_pg_nccl_timeout"):
            c10d.default_pg_nccl_timeout = kw["timeout"]
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False, **kw)
    return True


def shutdown_distributed(finished: bool = False) -> None:
    """Destroy the process group. `finished`: every rank got here the same way (a completed run),
    so a barrier first makes sure no rank closes its connections while a peer is still in a
    collective."""
    if dist.is_available() and dist.is_initialized():
        if finished and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a launched process once its work is done and written, skipping interpreter teardown: there,
    torch, gloo and DeepSpeed objects are destroyed in no particular order while their threads may
    still run, which on a loaded machine occasionally aborts (SIGABRT) a rank whose run had completed.
    Everything the run owns is closed before this point; only stdio and `logging` are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or vanished terminal
            pass
    os._exit(code)


def collective_failure(exc: BaseException) -> bool:
    """Does this exception come from a collective whose peer died or timed out?"""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text
        for s in (
            "connection closed by peer",
            "connection reset by peer",
            "timed out",
            "timeout",
            "gloo",
            "nccl",
            "broken pipe",
        )
    )


def rank_failure_message(exc: BaseException, timeout_s: float, run_dir: Path) -> str:
    latest = tag_format.latest_checkpoint(run_dir)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"a collective operation failed or waited more than parallel.timeout_s={timeout_s:g}s: another rank "
        f"died or hangs ({first[:300]}). This rank stops. Last complete checkpoint: "
        f"{latest if latest else 'none'}. Fix: find why the other rank stopped (its log), then restart every "
        "rank with --resume auto"
    )
