"""Data-parallel evaluation: work items shared across ranks, results gathered on rank 0.

Work is split by *batch index* (batch i goes to rank i % world), and per-item results are
reduced on rank 0 in the original item order, so N processes give bit-identical numbers
to 1 process. Launch under `torchrun`/`deepspeed` (env:// rendezvous) or spawn processes
that call `init(rank, world, ...)` themselves.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from common.deepspeed_import import import_deepspeed


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def init_from_env(backend: str | None = None) -> bool:
    """Join the process group described by torchrun/deepspeed env vars (WORLD_SIZE > 1); True if joined."""
    if is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    try:
        import_deepspeed().init_distributed(dist_backend=backend)
    except Exception:  # noqa: BLE001 - deepspeed absent or unusable: plain torch.distributed
        if not is_initialized():
            dist.init_process_group(backend=backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return True


def init(rank_: int, world: int, master_port: int, backend: str = "gloo") -> None:
    """Join an explicit group (used by spawned worker processes)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(backend=backend, rank=rank_, world_size=world)


def my_batches(batches: Sequence[Any]) -> list[tuple[int, Any]]:
    """This rank's share of the batches as (global index, batch)."""
    r, w = rank(), world_size()
    return [(i, b) for i, b in enumerate(batches) if i % w == r]


def gather_ordered(items: Iterable[tuple[int, Any]]) -> list[Any] | None:
    """Gather (index, value) pairs from every rank; on rank 0 (and on all ranks) the values sorted by index."""
    items = list(items)
    if world_size() > 1:
        parts: list[Any] = [None] * world_size()
        dist.all_gather_object(parts, items)
        items = [x for part in parts for x in part]
    return [v for _, v in sorted(items, key=lambda x: x[0])]
