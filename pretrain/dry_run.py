"""`--dry-run`: print the resolved config, parameter counts, FLOPs, memory per rank and the
layout, and refuse an impossible layout or data the run would refuse (read as the run reads it), without
hardware (meta tensors only). `--without-data` plans a run whose data is elsewhere."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import yaml

from common.errors import RecipeError
from model import ModelConfig

from . import loaders
from .config import RunConfig
from .layout import build_ds_config, plan_layout
from .memory import ZERO_DEFAULTS, choose_checkpointing, device_memory_bytes, estimates_by_mode, parameter_counts
from .metrics import train_flops_per_token
from .run_dir import resolved_config
from .task_model import model_config


def resolve_model(cfg: RunConfig, read_data: bool = True) -> tuple[ModelConfig, str]:
    """(the model a run of `cfg` would build, where its vocabulary comes from) without training: the
    vocabulary is the recipe's, else the data's, else the preset's when the data is not readable here
    (or not read: `read_data` False)."""
    vocab = cfg.model.fields.get("vocab_size")
    vocab_note = ""
    if vocab is None and not read_data:
        vocab_note = " (preset default; the data was not read: --without-data)"
    elif vocab is None:
        try:
            vocab = loaders.loader(cfg, "train").vocab_size
            vocab_note = " (from the data)"
        except Exception as e:  # noqa: BLE001 - a plan reports, it does not need the data
            vocab_note = f" (preset default; data not readable: {e})"
    mcfg = model_config(cfg, vocab)
    if vocab_note == " (from the data)" and mcfg.vocab_size != vocab:
        vocab_note = f" (the preset's; the data's vocabulary is {vocab})"
    return mcfg, vocab_note


def print_config(cfg: RunConfig, out=None) -> None:
    """`--print-config`: the resolved recipe (every default filled in, the model section resolved) as YAML."""
    out = out or sys.stdout
    mcfg, vocab_note = resolve_model(cfg)
    out.write(f"# resolved recipe; model.vocab_size={mcfg.vocab_size}{vocab_note}\n")
    out.write(yaml.safe_dump(resolved_config(cfg, mcfg), sort_keys=False))


def dry_run(cfg: RunConfig, world_size: int, out=None, data: bool = True) -> dict[str, Any]:
    """Print the plan; raise RecipeError for an impossible layout or, with `data`, for data the run would
    refuse (read as the run reads it, writing nothing). Builds nothing real."""
    layout = plan_layout(cfg, world_size)
    if data:
        try:
            probe = loaders.check_data(cfg, layout.data_parallel)
        except RecipeError as e:  # the run's own line, and the plan without the data
            msg, alt = str(e).rstrip(". "), "plan without the data: --dry-run --without-data"
            raise RecipeError(
                f"{msg}; or {alt}" if "Fix:" in msg else f"{msg}. Fix: make the data readable here, or {alt}"
            ) from None
        data_vocab = getattr(probe, "vocab_size", None)
        mcfg = model_config(cfg, data_vocab)
        named = "the recipe's" if "vocab_size" in cfg.model.fields else "the preset's"
        if data_vocab is None or data_vocab == mcfg.vocab_size:
            vocab_note = "" if data_vocab is None else " (from the data)"
        else:
            vocab_note = f" ({named}; the data's vocabulary is {data_vocab})"
    else:
        mcfg, vocab_note = resolve_model(cfg, read_data=False)
    layout.check_layers(mcfg.num_layers)
    fpt, src = train_flops_per_token(mcfg, cfg.train.seq_len, 0)
    zero = build_ds_config(cfg, layout, on_cpu=cfg.train.device == "cpu", hidden_size=mcfg.hidden_size).get(
        "zero_optimization", {}
    )
    keep = zero.get("stage3_param_persistence_threshold", ZERO_DEFAULTS["stage3_param_persistence_threshold"])
    trainable, frozen, _ = parameter_counts(mcfg, layout.zero_stage, keep)
    total = trainable + frozen
    # the device's memory where this machine has the run's device (`auto` picks from it), else unknown
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    device_type = "cuda" if on_cuda else "cpu"
    here = not on_cuda or torch.cuda.is_available()
    device_memory = device_memory_bytes(torch.device(device_type)) if here else None
    by_mode = estimates_by_mode(cfg, layout, mcfg, zero, device_type, device_memory)
    mode = cfg.train.activation_checkpointing
    if mode == "auto" and device_memory is not None:
        mode, reason = choose_checkpointing({m: e["total_gib"] for m, e in by_mode.items()}, device_memory)
    elif mode == "auto":
        reason = "auto: chosen at the start from the device's memory (none here); the estimate shown is full's"
        mode = "full"
    else:
        reason = "train.activation_checkpointing"
    mem = by_mode[mode]
    info = {
        "params_total": total,
        "params_trainable": trainable,
        "params_frozen": total - trainable,
        "frozen_groups": sorted(mcfg.frozen_groups_at(0)),
        "schedule_boundaries": mcfg.schedule_boundaries(),
        "train_flops_per_token": fpt,
        "flops_source": src,
        "memory_per_rank_gib": mem,
        "memory_by_checkpointing_gib": {m: e["total_gib"] for m, e in by_mode.items()},
        "activation_checkpointing": mode,
        "layout": layout.describe(),
        "zero_optimization": zero,
        "tokens_per_step": cfg.tokens_per_step,
        "max_steps": cfg.max_steps,
    }
    out = out or sys.stdout
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("# resolved config")
    p(yaml.safe_dump(resolved_config(cfg, mcfg), sort_keys=False).rstrip())
    p("# summary")
    p(f"vocab_size: {mcfg.vocab_size}{vocab_note}")
    p(
        f"parameters: total {total:,} | trainable {trainable:,} | frozen {total - trainable:,} "
        f"(frozen groups at step 0: {info['frozen_groups']}; schedule boundaries: {info['schedule_boundaries']})"
    )
    p(f"FLOPs per token (fwd+bwd): {fpt:,.0f} [{src}]; per step: {fpt * cfg.tokens_per_step:.3e}")
    p(
        f"tokens per step: {cfg.tokens_per_step:,}; steps: {cfg.max_steps:,}; tokens: {cfg.tokens_per_step * cfg.max_steps:,}"
    )
    p(f"layout: {layout.describe()}")
    p(f'deepspeed zero_optimization ({cfg.parallel.ds_config}, "auto" resolved): {json.dumps(zero)}')
    fmt = lambda v: f"{v:.2f} GiB" if v >= 1 else f"{v * 1024:.2f} MiB"  # noqa: E731
    p(f"activation checkpointing: {mode} ({reason})")
    p("memory per rank (estimate): " + ", ".join(f"{k[:-4]} {fmt(v)}" for k, v in mem.items()))
    p(
        "memory per rank by checkpointing mode (estimate, total): "
        + ", ".join(f"{m} {fmt(e['total_gib'])}" for m, e in by_mode.items())
    )
    return info
