"""Downstream evaluations during training, as recipe keys: `eval.tasks` (docs/TRAINING.md).

    eval:
      tasks: [bits_per_byte, induction, exact_match:prompts.jsonl]

Each task becomes a training hook (pretrain/hooks.py), run at the validation cadence on the plain
model, and what it returns is logged with that step under `eval/...`. A bad task, a missing file or
a missing tokenizer is refused before the engine is built.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from common.errors import RecipeError, UserError
from data_pipeline.config import DataConfig
from data_pipeline.shards import MANIFEST, read_manifest
from eval import exact_match as em
from eval import retrieval
from eval.loading import load_tokenizer
from eval.perplexity import perplexity, shard_stream
from eval.report import flatten

from .config import RunConfig
from .hooks import TrainHook

NAMED = ("bits_per_byte", "induction")
NEEDS_TOKENIZER = ("bits_per_byte", em.PREFIX)


def run_tokenizer(cfg: RunConfig):
    """The tokenizer the recipe trains with: `data.tokenizer`, else the one its shards were prepared with."""
    data = cfg.data
    spec = getattr(data, "tokenizer", None)
    if spec is None and isinstance(data, DataConfig) and (Path(data.source) / MANIFEST).is_file():
        spec = read_manifest(data.source).get("tokenizer_path")
    return load_tokenizer(spec) if spec else None


def task_hooks(cfg: RunConfig) -> list[TrainHook]:
    """One hook per `eval.tasks` entry, each checked (and its inputs read) now, before any training."""
    tasks = cfg.eval.tasks
    for t in tasks:
        if t not in NAMED and not (t.startswith(em.PREFIX) and len(t) > len(em.PREFIX)):
            raise RecipeError(
                f"eval.tasks: unknown task {t!r}. Fix: use bits_per_byte, induction or exact_match:FILE.jsonl"
            )
    if not tasks:
        return []
    tok = None
    if any(t.startswith(NEEDS_TOKENIZER) for t in tasks):
        try:
            tok = run_tokenizer(cfg)
        except UserError as e:
            raise RecipeError(f"eval.tasks {tasks}: {e}") from None
        if tok is None:
            raise RecipeError(
                f"eval.tasks {tasks} need the run's tokenizer, which neither data.tokenizer nor the data's "
                "manifest names. Fix: set data.tokenizer to the tokenizer directory the data was prepared with"
            )
    hooks = []
    for t in tasks:
        if t == "bits_per_byte":
            hooks.append(_bits_per_byte(cfg, tok))
        elif t == "induction":
            hooks.append(_induction(cfg))
        else:
            hooks.append(_exact_match(cfg, tok, t))
    return hooks


def _bits_per_byte(cfg: RunConfig, tok) -> TrainHook:
    sets = getattr(cfg.data, "val_sets", None) or {}
    if not sets:
        raise RecipeError(
            "eval.tasks bits_per_byte evaluates the named validation sets, and data.val_sets names none. "
            "Fix: add data.val_sets: {name: prepared shard dir, ...}"
        )
    streams = {name: shard_stream(path, tok) for name, path in sets.items()}  # (tokens, bytes), decoded once

    def hook(model, step: int) -> dict[str, Any]:
        out, bits, nbytes = {}, 0.0, 0
        for name, (toks, n_bytes) in streams.items():
            r = perplexity(model, toks, batch_size=cfg.eval.batch_size, n_bytes=n_bytes, progress=False)
            out[f"eval/bpb/{name}"] = r["bits_per_byte"]
            bits += r["loss"] * r["tokens"] / math.log(2)
            nbytes += n_bytes
        out["eval/bpb"] = bits / nbytes
        return out

    return hook


def _induction(cfg: RunConfig) -> TrainHook:
    def hook(model, step: int) -> dict[str, Any]:
        got = retrieval.induction(model, tuple(cfg.eval.induction_lengths), cfg.eval.n, cfg.seed, progress=False)
        return {f"eval/{k}": v for k, v in flatten({"induction": got}).items()}

    return hook


def _exact_match(cfg: RunConfig, tok, task: str) -> TrainHook:
    path = em.task_file(task)
    try:
        em.read_records(path)  # a missing or malformed file fails now
    except UserError as e:
        raise RecipeError(f"eval.tasks {task}: {e}") from None
    key = f"eval/exact_match/{path.stem}"

    def hook(model, step: int) -> dict[str, Any]:
        got = em.evaluate_exact_match(model, tok, path, max(cfg.eval.batch_size, 32), progress=False)
        return {f"{key}/{k}": v for k, v in flatten(got).items()}

    return hook
