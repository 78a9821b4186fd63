"""Writing and reading the engine's checkpoints (the tag-dir format is checkpoint/tag_format.py).

A save is collective: every rank writes its DeepSpeed files, the data-parallel rank 0 of each
pipeline stage its frozen tensors, every rank its RNG state, and fsyncs what it wrote; only when
every rank reports success does rank 0 mark the tag complete and move `latest`.

A failed write (OSError, torch's RuntimeError, SafetensorError) is caught on the rank where it
happens, which then goes on through the save's remaining collectives without writing (DeepSpeed's
writes go through `_RankWrites.engine_writes`, so its internal barriers still pair up). The ranks
then agree to abandon the checkpoint: rank 0 removes the partial tag dir and every rank raises the
same `CheckpointWriteFailed`, at once rather than at the collective timeout.

A load scans every pickle before DeepSpeed starts, and DeepSpeed reads each file weights-only from
the same open file that was scanned (`guarded_torch_load`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoint import tag_format
from checkpoint.pickle_scan import guarded_torch_load, verify_checkpoint_dir
from common.constants import free_space, fsync_path
from common.errors import CheckpointWriteFailed, CorruptCheckpoint, NonFiniteLoss

from . import faults
from .bounds import CollectiveBounds
from .checkpoint_writer import CheckpointWriter, SaveTiming
from .distributed import collective_timeout, comm_failure


class _RankWrites:
    """This rank's writes during one save: the files it wrote (to fsync) and its first failure.
    After a failure it writes nothing more."""

    def __init__(self, where: Path):
        self.where = where  # the filesystem whose free space a failure reports
        self.paths: list[str] = []
        self.error: str | None = None

    def run(self, fn: Callable[[], Any], *paths: str | os.PathLike) -> None:
        if self.error is not None:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - any failed write (OSError, torch's RuntimeError, SafetensorError)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self.error = (
                f"{type(e).__name__}: {first}" if first else type(e).__name__
            ) + f", with {free_space(self.where)} free on that filesystem"
            return
        self.paths += [str(p) for p in paths]

    @contextlib.contextmanager
    def engine_writes(
        self, engine, deferred: list[Callable[[], None]] | None = None, staging: dict[str, Any] | None = None
    ) -> Iterator[None]:
        """Route DeepSpeed's writes during `save_checkpoint` (its checkpoint engine's `save` and the
        recovery-script copy) through `run`. With `deferred`, each state dict is copied into host memory
        now (training moves the live state on) and its write appended there: the copy goes into the
        tensors of the same file's copy at the last save, kept in `staging` (touched memory copies
        several times faster than fresh allocations), and DeepSpeed's own copy for `torch.save` is off
        (`preserves_storage_sharing`), so each tensor is copied once."""
        ce = engine.checkpoint_engine
        if deferred is None:
            real_save = ce.save
        else:
            zipfile = getattr(ce, "zipfile_serialization", False)  # as DeepSpeed's torch engine writes it
            staging = {} if staging is None else staging

            def real_save(state_dict, path):
                name = os.path.basename(path)
                snapshot = staging[name] = copy_to_host(state_dict, staging.get(name))
                deferred.append(lambda: torch.save(snapshot, path, _use_new_zipfile_serialization=zipfile))

            ce.preserves_storage_sharing = lambda: False
        ce.save = lambda state_dict, path: self.run(lambda: real_save(state_dict, path), path)
        real_copy = getattr(engine, "_copy_recovery_script", None)
        if real_copy is not None and deferred is not None:
            engine._copy_recovery_script = lambda save_path: deferred.append(lambda: real_copy(save_path))
        elif real_copy is not None:
            engine._copy_recovery_script = lambda save_path: self.run(lambda: real_copy(save_path))
        try:
            yield
        finally:
            del ce.save
            if deferred is not None:
                del ce.preserves_storage_sharing
            if real_copy is not None:
                del engine._copy_recovery_script

    def fsync(self) -> None:
        self.run(lambda: [fsync_path(p) for p in dict.fromkeys(self.paths)])


def copy_to_host(item, into=None):
    """`item` (tensors in nested dicts, lists and tuples) with every tensor copied to a CPU tensor of its
    own: into the matching tensor of `into` (a copy made earlier of the same structure) where shape and
    dtype agree, else a new one."""
    if isinstance(item, torch.Tensor):
        if isinstance(into, torch.Tensor) and into.shape == item.shape and into.dtype == item.dtype:
            return into.copy_(item.detach())
        return item.detach().to("cpu", copy=True)
    if isinstance(item, (list, tuple)):  # as plain lists and tuples, as DeepSpeed's clone_tensors_for_torch_save
        into = into if isinstance(into, (list, tuple)) and len(into) == len(item) else [None] * len(item)
        copied = [copy_to_host(v, w) for v, w in zip(item, into)]
        return copied if isinstance(item, list) else tuple(copied)
    if isinstance(item, dict):
        into = into if isinstance(into, dict) else {}
        return type(item)({k: copy_to_host(v, into.get(k)) for k, v in item.items()})
    return item


def _agree(writes: _RankWrites, tag_dir: Path, run_dir: Path, device: torch.device, group=None) -> None:
    """Collective (over `group`, default: every rank's): returns when every rank's writes succeeded;
    otherwise every rank raises the same CheckpointWriteFailed after rank 0 has removed the partial tag dir."""
    failed = torch.tensor([0.0 if writes.error is None else 1.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, writes.error, group=group)
    if dist.get_rank() == 0:
        tag_format.discard(tag_dir)  # every rank has stopped writing into it
    dist.barrier(group=group)
    latest = tag_format.latest_checkpoint(run_dir)
    which = "; ".join([f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None][:4])
    raise CheckpointWriteFailed(
        f"could not write checkpoint {tag_dir.name} ({which}); "
        f"every rank abandoned it, the partial files were removed and the last complete checkpoint "
        f"{latest if latest else '(none yet)'} is untouched. Fix: free space under {run_dir} (or lower "
        "checkpoint.keep_last), then rerun with --resume auto"
    )


def save(
    model_engine,
    run_dir: Path,
    step: int,
    trainer_state: dict[str, Any],
    keep_last: int,
    writer: CheckpointWriter | None,
    timing: SaveTiming,
) -> Path:
    """Collective: write, fsync and mark complete the checkpoint of `step` (raises
    CheckpointWriteFailed on every rank when any rank could not write). With `writer`, the state is
    copied into host memory here and written, fsynced and marked by the writer's thread
    (pretrain/checkpoint_writer.py), which sets `timing.complete_s` when the tag is complete."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO  # deferred: heavy (deepspeed)

    started = time.perf_counter()
    root = tag_format.ckpt_root(run_dir)
    tag_dir = root / tag_format.tag_for(step)
    rank, device = dist.get_rank(), model_engine.device
    prepare = _RankWrites(root)
    if rank == 0 and tag_dir.exists():
        prepare.run(lambda: tag_format.discard(tag_dir))  # rewriting a tag: start from an empty dir
    _agree(prepare, tag_dir, run_dir, device)
    writes = _RankWrites(root)
    deferred: list[Callable[[], None]] | None = None if writer is None else []
    with writes.engine_writes(model_engine.engine, deferred, writer.staging if writer else None):
        model_engine.engine.save_checkpoint(
            str(root),
            tag=tag_dir.name,
            client_state={UNIVERSAL_CHECKPOINT_INFO: {}, "trainer_state": trainer_state},
            save_latest=False,
        )
    frozen = model_engine.frozen_tensors()  # collective under ZeRO-3: every rank takes part
    stage = model_engine.engine.stage_id if model_engine.pipe else 0
    frozen_path, rng_path = tag_format.frozen_file(tag_dir, stage), tag_format.rng_file(tag_dir, rank)
    if deferred is None:
        if model_engine.dp_rank == 0:
            writes.run(lambda: tag_format.save_frozen(tag_dir, stage, frozen), frozen_path)
        writes.run(lambda: tag_format.save_rng(tag_dir, rank), rng_path)
        _commit(writes, run_dir, tag_dir, step, trainer_state, keep_last, device)
        timing.complete_s = time.perf_counter() - started
        return tag_dir
    if model_engine.dp_rank == 0:
        frozen = writer.staging["frozen"] = copy_to_host(frozen, writer.staging.get("frozen"))
        writes.run(lambda: deferred.append(lambda: tag_format.save_frozen(tag_dir, stage, frozen)), frozen_path)
    rng, trainer_state = tag_format.rng_state(), copy.deepcopy(trainer_state)  # as they are at this step
    writes.run(lambda: deferred.append(lambda: tag_format.save_rng(tag_dir, rank, rng)), rng_path)
    cpu = torch.device("cpu")  # the writer's group is gloo
    writer.submit(
        lambda: _commit(writes, run_dir, tag_dir, step, trainer_state, keep_last, cpu, deferred, writer.group),
        timing,
        started,
    )
    return tag_dir


def _commit(writes, run_dir, tag_dir, step, trainer_state, keep_last, device, deferred=(), group=None) -> None:
    """Collective over `group`: do the `deferred` writes, fsync this rank's files, agree that every
    rank's are on disk, then rank 0 marks the tag complete and moves `latest`."""
    for write in deferred:
        writes.run(write)
    writes.fsync()  # this rank's files reach the disk before the marker can exist
    faults.pause("save", step)
    _agree(writes, tag_dir, run_dir, device, group)
    done = _RankWrites(tag_format.ckpt_root(run_dir))
    if dist.get_rank() == 0:
        failure = comm_failure()  # NCCL aborted a communicator: what was agreed over it may be garbage
        if failure:
            done.error = f"a collective failed before the marker was written ({failure})"
        done.run(lambda: tag_format.finalize(run_dir, tag_dir, trainer_state, keep_last))
    _agree(done, tag_dir, run_dir, device, group)


def load(model_engine, tag_dir: Path, universal: bool, seed: int) -> None:
    """Weights, optimizer, frozen tensors and this rank's RNG (re-seeded from `seed` when the
    checkpoint has none for this rank, e.g. a universal checkpoint)."""
    verify_checkpoint_dir(tag_dir)  # refuse a crafted file before DeepSpeed reads any
    with guarded_torch_load():  # and DeepSpeed unpickles only what was scanned, weights-only
        path, _ = model_engine.engine.load_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    if path is None:
        raise CorruptCheckpoint(
            f"DeepSpeed found no checkpoint it could load in {tag_dir}. Fix: check that the directory holds a "
            "complete checkpoint of this run, or resume from another one with --resume PATH"
        )
    model_engine.restore_frozen(tag_format.load_frozen(tag_dir))
    if not tag_format.load_rng(tag_dir, dist.get_rank()):
        torch.manual_seed(seed + dist.get_rank())


class Checkpointer:
    """A run's saves: each one collective (`save` above), written on a thread with
    `checkpoint.background`, and timed."""

    def __init__(self, run_dir: Path, keep_last: int, background: bool, timeout_s: float, bounds: CollectiveBounds):
        """A save's collectives, and a rollback's, wait for the slowest rank's writes or reads, up to `timeout_s`
        (checkpoint.timeout_s), never less than the bound of every other collective (`bounds`, pretrain/bounds.py)."""
        self.run_dir, self.keep_last, self.timeout_s, self.bounds = run_dir, keep_last, timeout_s, bounds
        self.writer = CheckpointWriter(max(timeout_s, bounds.now_s)) if background else None
        if self.writer:
            bounds.exempt.append(self.writer.group)
        self.saves: list[SaveTiming] = []  # each save's blocked and until-complete seconds

    def waiting(self):
        """Inside the block, every group but the writer's waits a save's bound; the step bound after it."""
        now = self.bounds.now_s
        return collective_timeout(max(self.timeout_s, now), now, skip=self.bounds.exempt)

    def save(self, model_engine, step: int, trainer_state: dict[str, Any]) -> Path:
        """A failed write raises CheckpointWriteFailed on every rank after the partial checkpoint is
        removed; the last complete one stays. In the background, the save before it is waited for
        first (its failure raised here)."""
        started = time.perf_counter()
        self.wait()
        timing = SaveTiming(step, 0.0)
        with self.waiting():
            path = save(model_engine, self.run_dir, step, trainer_state, self.keep_last, self.writer, timing)
        timing.blocked_s = time.perf_counter() - started
        self.saves.append(timing)
        return path

    def rollback(self, model_engine, seed: int, step: int, log: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
        """Load the newest intact checkpoint into `model_engine` (weights and optimizer, rebuilt first when
        the checkpoint's trainable set differs) after a non-finite loss at `step`; returns (its tag dir, its
        trainer state) for the loop to restore its own part (the data position, the step)."""
        self.wait()  # a save in flight is complete (or abandoned) before choosing one
        tag_dir, notes = tag_format.newest_good_checkpoint(self.run_dir)
        for note in notes:
            log(note)
        if tag_dir is None:
            raise NonFiniteLoss(
                f"non-finite loss at step {step + 1} and train.nan_policy=rollback, but "
                f"{self.run_dir} has no complete checkpoint yet. Fix: set checkpoint.every_steps, "
                "or train.nan_policy=skip"
            )
        st = tag_format.read_state(tag_dir)
        trainable_step = int(st["trainable_step"])
        if model_engine.mcfg.frozen_groups_at(trainable_step) != model_engine.mcfg.frozen_groups_at(
            model_engine.trainable_step
        ):
            model_engine.rebuild(trainable_step)
        with self.waiting():
            load(model_engine, tag_dir, False, seed)
        return tag_dir, st

    def wait(self, raise_error: bool = True) -> None:
        """The save in flight, if any, is complete (or abandoned) when this returns."""
        if self.writer is not None:
            self.writer.wait(raise_error=raise_error)
