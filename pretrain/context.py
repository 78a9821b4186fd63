"""What a run's components are built from (pretrain/setup.py): the recipe, where the run lives and
what it resumes from, this process's place in the world, and the model config and layout the
data sized. One object, so a component's constructor takes it instead of a list of arguments."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from model import ModelConfig

if TYPE_CHECKING:  # the modules below build from a RunContext themselves
    from .config import RunConfig
    from .layout import Layout
    from .resume import ResumePoint


@dataclass(frozen=True)
class RunContext:
    cfg: RunConfig
    mcfg: ModelConfig
    layout: Layout
    device: torch.device
    run_dir: Path
    point: ResumePoint  # the checkpoint continued from (tag_dir None: a fresh run)
    rank: int
    world: int
    resolved: dict[str, Any]  # the resolved recipe, as config.yaml, the trackers and checkpoints record it
