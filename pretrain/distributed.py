"""The process group: which device a rank uses, starting and ending torch.distributed, and
turning a failed collective (a peer died or hangs) into a message that says what to do."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from checkpoint import tag_format
from common.cli import STOPPED, print_error
from common.deepspeed_import import import_deepspeed
from common.errors import RankFailure, RecipeError, RendezvousError

from .rendezvous import first_line, init_process_group, launched_world, where

# NCCL's failure behaviour, stated rather than left to torch's defaults (launch.sh exports the same;
# values already in the environment win). A failed or timed-out collective (pretrain/bounds.py) is seen
# by NCCL's watchdog thread, never by the Python call: with 2 (CleanUpOnly) the watchdog aborts the
# communicators, so no kernel waits for a dead peer, but leaves the process to `watch_collectives`, which
# ends it with the project's message (1, TearDown, would abort the process with torch's log only);
# PROPAGATE_ERROR tells every rank through the rendezvous store, so ranks that never talk to the dead
# peer stop too instead of waiting out their own timeout; BLOCKING_WAIT=0 keeps collectives
# asynchronous (1 would make each one a host sync). docs/TRAINING.md, "When a rank dies under NCCL".
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_PROPAGATE_ERROR": "1",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}

# The environment of a process that is its own world of one (a plain run, a benchmark). No peer looks for
# its store, so port 0 lets the store bind a free port itself: a port probed free before the bind can be
# taken meanwhile by another process started beside it (EADDRINUSE, seen with 13 runs on one machine).
SOLO_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "LOCAL_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "0",
}


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


def init_distributed(device: torch.device, timeout_s: float | None = None, rendezvous_s: float | None = None) -> bool:
    """Initialise torch.distributed through DeepSpeed; returns True when this call created it.
    `timeout_s` bounds every collective (a dead or hung peer ends the run instead of hanging it); with
    `rendezvous_s`, the ranks of a launched job first meet within that bound (pretrain/rendezvous.py)."""
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
    gloo_interface()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {}
    if timeout_s:
        kw["timeout"] = datetime.timedelta(seconds=timeout_s)
        set_default_timeout(timeout_s)
    if rendezvous_s and launched_world() > 1:  # DeepSpeed then takes over the group made here
        init_process_group(backend, int(os.environ["RANK"]), launched_world(), rendezvous_s)
        if timeout_s:
            set_group_timeouts(timeout_s)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, **kw)
    return True


def check_interface() -> None:
    """The interfaces the ranks are told to use exist on this node: GLOO_SOCKET_IFNAME's by name, else one of
    NCCL_SOCKET_IFNAME's as NCCL reads them (prefixes; `=NAME` exact; a `^` exclusion is not checked). gloo would
    fail on a missing one only while connecting, with a traceback, after every rank had waited for this one."""
    have = sorted(name for _, name in socket.if_nameindex())
    gloo, nccl = os.environ.get("GLOO_SOCKET_IFNAME", ""), os.environ.get("NCCL_SOCKET_IFNAME", "")
    if gloo:
        missing = [n for n in gloo.split(",") if n and n not in have]
    elif nccl and not nccl.startswith("^"):  # NCCL takes the interfaces that match any of its names
        names = [n for n in nccl.lstrip("=").split(",") if n]
        exact = nccl.startswith("=")
        matched = any(h == n or (not exact and h.startswith(n)) for n in names for h in have)
        missing = [] if matched else names
    else:
        missing = []
    if missing:
        raise RendezvousError(
            f"{where()} has no network interface {', '.join(missing)} (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, set by "
            f"launch.sh --iface; it has {', '.join(have)}). Fix: --iface with a name every node has (ip -br link; "
            "python -m pretrain.preflight --iface NAME checks every node)"
        )


def gloo_interface() -> None:
    """A gloo group (the CPU backend; on GPUs, the background checkpoint writer's) binds the address its host
    name resolves to, often another network than the one NCCL was told to use, or 127.0.1.1: unless
    GLOO_SOCKET_IFNAME is set, it takes NCCL_SOCKET_IFNAME's interface where that names plain interfaces
    (NCCL's `^` exclusions and `=` exact-match prefix mean nothing to gloo). Read when a gloo group is made."""
    nccl = os.environ.get("NCCL_SOCKET_IFNAME", "")
    if nccl and not nccl.startswith(("^", "=")):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", nccl)


def comm_failure() -> str | None:
    """'group NAME: ERROR' for the first process group whose NCCL backend recorded a failure (TIMEOUT,
    COMM_ERROR, or REMOTE_ERROR: a peer's, through TORCH_NCCL_PROPAGATE_ERROR), else None. gloo groups
    have no such record: their failures raise in the calling thread."""
    try:
        groups = list(c10d._world.pg_map)
    except RuntimeError:  # a group was being created as we read
        return None
    for pg in groups:
        try:
            error = pg._get_backend(torch.device("cuda")).get_error()
        except (AttributeError, RuntimeError, ValueError):  # not NCCL, or a torch without get_error
            continue
        if error.name != "SUCCESS":
            return f"group {pg.group_name}: NCCL {error.name}"
    return None


def watch_collectives(
    run_dir: Path, bound: Callable[[], str], probe: Callable[[], str | None], poll_s: float = 0.5
) -> threading.Event:
    """Every `poll_s`, ask `probe` whether a collective failed (comm_failure under NCCL); if so, print the
    project's message (rank_failure_message: the last complete checkpoint and the fix) and end this rank
    with exit code 3. Under NCCL the main thread may sit in a CUDA sync on a collective that never
    completes, so only another thread can speak for it. `bound` says the collective bound in force. Set the
    returned event to stop watching."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            failure = probe()
            if failure:
                print_error(RankFailure(rank_failure_message(RuntimeError(failure), bound(), run_dir)))
                exit_process(STOPPED)

    threading.Thread(target=watch, name="collective-watch", daemon=True).start()
    return stop


def set_default_timeout(seconds: float) -> None:
    """The bound of the groups made from now on. DeepSpeed creates its data/pipeline/ZeRO groups with
    `new_group(ranks)`, which takes torch's module-level default (30 min for gloo), not the world group's
    timeout: without this, a peer that hangs inside a sub-group collective holds this rank for 30 minutes."""
    c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = c10d.default_pg_timeout


def set_group_timeouts(seconds: float, skip=()) -> None:
    """Every process group but `skip` may wait `seconds` in a collective from now on."""
    for pg in [g for g in c10d._world.pg_map if g not in skip]:
        with contextlib.suppress(ValueError, RuntimeError):  # a group this rank is not in
            c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), pg)


@contextlib.contextmanager
def collective_timeout(seconds: float, restore: float, skip=()) -> Iterator[None]:
    """Inside the block every process group but `skip` may wait `seconds` in a collective (a checkpoint save:
    the ranks wait for the slowest writer on a shared filesystem, which the step bound, set to catch a
    hung step, should not cut short); `restore` after it."""
    if seconds == restore or not dist.is_initialized():
        yield
        return
    set_group_timeouts(seconds, skip)
    try:
        yield
    finally:
        set_group_timeouts(restore, skip)


def shutdown_distributed(finished: bool = False, run_dir: Path | None = None) -> None:
    """Destroy the process group. `finished`: every rank got here the same way (a completed run),
    so a barrier first makes sure no rank closes its connections while a peer is still in a
    collective; a peer that never gets there stops this rank with the project's message (RankFailure)
    naming `run_dir`'s last complete checkpoint."""
    if dist.is_available() and dist.is_initialized():
        if finished and dist.get_world_size() > 1:
            try:
                dist.barrier()
            except Exception as e:
                if not collective_failure(e):
                    raise
                latest = tag_format.latest_checkpoint(run_dir) if run_dir is not None else None
                raise RankFailure(
                    f"this rank finished the run, but another rank did not reach its end ({first_line(e)}). "
                    f"Last complete checkpoint: {latest or 'none'}. Fix: find why the other rank stopped (its "
                    "log); --resume auto continues from that checkpoint"
                ) from e
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


def rank_failure_message(exc: BaseException, bound: str, run_dir: Path) -> str:
    """The line a rank stops with when a collective failed: the bound in force (`bound`), the last complete
    checkpoint and the fix."""
    latest = tag_format.latest_checkpoint(run_dir)
    cause = "another rank died or hangs"
    if "size doesn't match" in str(exc) or "size does not match" in str(exc):
        cause = "the ranks sent tensors of different sizes, so they do not run the same model or data"
    return (
        f"a collective operation failed or waited more than {bound}: {cause} ({first_line(exc)}). "
        f"This rank stops. Last complete checkpoint: {latest if latest else 'none'}. Fix: find why the other rank "
        "stopped (its log), then restart every rank with --resume auto"
    )
