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
from model.transformer import Transformer

from . import loaders
from .config import RunConfig
from .layout import ZERO_DEFAULTS, build_ds_config, memory_estimate, plan_layout
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
    with torch.device("meta"):
        model = Transformer(mcfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    fpt, src = train_flops_per_token(mcfg, cfg.train.seq_len, 0)
    zero = build_ds_config(cfg, layout, on_cpu=cfg.train.device == "cpu", hidden_size=mcfg.hidden_size).get(
        "zero_optimization", {}
    )
    keep = zero.get("stage3_param_persistence_threshold", ZERO_DEFAULTS["stage3_param_persistence_threshold"])
    persistent = sum(p.numel() for p in model.parameters() if p.numel() <= keep) if layout.zero_stage == 3 else 0
    mem = memory_estimate(cfg, layout, mcfg, trainable, total - trainable, zero, persistent)
    info = {
        "params_total": total,
        "params_trainable": trainable,
        "params_frozen": total - trainable,
        "frozen_groups": sorted(mcfg.frozen_groups_at(0)),
        "schedule_boundaries": mcfg.schedule_boundaries(),
        "train_flops_per_token": fpt,
        "flops_source": src,
        "memory_per_rank_gib": mem,
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
    p("memory per rank (estimate): " + ", ".join(f"{k[:-4]} {fmt(v)}" for k, v in mem.items()))
    return info
