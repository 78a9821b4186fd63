"""Where a run continues from, and refusing a checkpoint that does not fit the run.

A checkpoint fits when it describes the same model (variant, shapes), was trained on the same
tokenizer as the data, and was written under the same parallel layout (DeepSpeed's
partitioned files only load under the layout that wrote them; a universal checkpoint loads
under any). Its learning-rate schedule: pretrain/schedule_change.py.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from checkpoint import tag_format
from common.errors import RecipeError
from model import ModelConfig
from model.io import check_compatible

from .config import RunConfig
from .layout import Layout

RENDEZVOUS = ".rendezvous"  # rank 0's mark in the run dir, which every rank must see


@dataclass
class ResumePoint:
    tag_dir: Path | None  # None: a fresh run
    state: dict[str, Any]  # the checkpoint's trainer_state.json ({} for a fresh run)
    universal: bool  # DeepSpeed must load it as a universal checkpoint
    notes: list[str] = field(default_factory=list)  # newer checkpoints passed over, and why

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))

    @property
    def trainable_step(self) -> int:
        return int(self.state.get("trainable_step", self.step))


def resume_point(cfg: RunConfig, run_dir: Path, resume: str | None, overwrite: bool) -> ResumePoint:
    """`--resume auto|never|PATH` -> the checkpoint to continue from (none with `--overwrite`): the
    newest whose files match its marker; newer ones that do not are passed over, with a note."""
    try:
        tag_dir, notes = (None, []) if overwrite else tag_format.resolve_resume(resume, run_dir)
    except FileNotFoundError as e:
        raise RecipeError(str(e)) from None
    state = tag_format.read_state(tag_dir) if tag_dir is not None else {}
    return ResumePoint(tag_dir, state, bool(cfg.checkpoint.load_universal or state.get("universal")), notes)


def check_fits(point: ResumePoint, cfg: RunConfig, mcfg: ModelConfig, data_tokenizer_id: str | None) -> None:
    """The checkpoint's model and tokenizer are the run's."""
    if point.tag_dir is None:
        return
    try:
        check_compatible(mcfg, ModelConfig.from_dict(point.state["model_config"]), str(point.tag_dir))
    except ValueError as e:
        raise RecipeError(str(e)) from None
    ckpt_tok = point.state.get("tokenizer_id")
    if data_tokenizer_id is not None and ckpt_tok is not None and data_tokenizer_id != ckpt_tok:
        raise RecipeError(
            f"checkpoint {point.tag_dir} was trained on tokenizer {ckpt_tok} but data.source "
            f"{cfg.data.source} uses {data_tokenizer_id}; token ids would mean other things. Fix: "
            "the data the checkpoint was trained on, or another --run-dir / --resume never"
        )


def check_layout(point: ResumePoint, layout: Layout, run_dir: Path) -> None:
    """DeepSpeed's partitioned files load only under the layout that wrote them."""
    if point.tag_dir is None or point.universal:
        return
    st = point.state
    saved = (
        st.get("pipeline_stages", 1),
        st.get("data_parallel", st.get("world_size", 1)),
        st.get("zero_stage", layout.zero_stage),
    )
    now = (layout.pipeline_stages, layout.data_parallel, layout.zero_stage)
    if saved != now and (max(saved[2], now[2]) >= 1 or saved[0] != now[0]):
        raise RecipeError(
            f"checkpoint {point.tag_dir} was written with pipeline {saved[0]} x data {saved[1]}, ZeRO-{saved[2]}; "
            f"this run is pipeline {now[0]} x data {now[1]}, ZeRO-{now[2]}. DeepSpeed's partitioned files only "
            f"load under the same layout. Fix: python -m pretrain.universal --checkpoint {point.tag_dir} --out "
            f"{run_dir / 'universal'} and resume from the converted checkpoint (docs/TRAINING.md)"
        )


def agreed_resume_point(
    cfg: RunConfig, run_dir: Path, resume: str | None, overwrite: bool, rank: int, world: int
) -> ResumePoint:
    """One resume decision for every rank (collective). Rank 0 marks the run dir and picks the checkpoint;
    every rank must see that mark (the run dir is on a filesystem all nodes share) and read the checkpoint
    rank 0 picked, else every rank raises the same RecipeError naming the ranks, hosts and paths. Decided
    per rank, a node whose disk lacks the checkpoint would start fresh while the others resume, and the
    job would hang in its first collective until the collective bound. The mark goes once every rank has
    looked (with the run dir, where it held nothing else), so a run refused later leaves nothing behind."""
    if world == 1:  # one process: nothing to agree on, nothing to mark
        return resume_point(cfg, run_dir, resume, overwrite)
    token, point, error, made = None, None, None, False
    if rank == 0:
        made = not Path(run_dir).exists()
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        (Path(run_dir) / RENDEZVOUS).write_text(token)
        try:
            point = resume_point(cfg, run_dir, resume, overwrite)
        except RecipeError as e:  # said on every rank, not on rank 0 alone while the others wait
            error = str(e)
    marker = Path(run_dir) / RENDEZVOUS

    def unmark() -> None:  # rank 0, once every rank has looked
        marker.unlink(missing_ok=True)
        if made and not any(Path(run_dir).iterdir()):
            Path(run_dir).rmdir()

    tag = None if point is None or point.tag_dir is None else str(point.tag_dir)
    shared = [token, tag, error, str(Path(run_dir).resolve())]
    dist.broadcast_object_list(shared, src=0)
    token, tag, error, first = shared
    if error:
        if rank == 0:
            unmark()
        raise RecipeError(error)
    problem = ""
    if not (marker.is_file() and marker.read_text() == token):
        here = str(Path(run_dir).resolve())
        own = "" if here == first else f" (its own is {here})"
        problem = f"does not see rank 0's run dir {first}{own}: rank 0's mark is missing there or another run's"
    elif rank != 0:
        try:
            state = tag_format.read_state(Path(tag)) if tag is not None else {}
            universal = bool(cfg.checkpoint.load_universal or state.get("universal"))
            point = ResumePoint(None if tag is None else Path(tag), state, universal)
        except (OSError, ValueError) as e:
            problem = f"cannot read the checkpoint rank 0 resumes from, {tag} ({type(e).__name__}: {e})"
    problems = [None] * world
    dist.all_gather_object(problems, (rank, socket.gethostname(), problem))
    if rank == 0:
        unmark()
    bad = [f"rank {r} on {host} {p}" for r, host, p in problems if p]
    if bad:
        raise RecipeError(
            f"{'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}. Fix: put the run dir on a filesystem every "
            "node mounts at the same path (--run-dir), and check that node's mount"
        )
    return point
