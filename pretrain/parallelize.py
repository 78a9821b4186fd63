"""Each rank's model, built where it lives, with parallelism applied from outside in one place.

`build_local` (after torchtitan): construct the module without allocating it (on the meta device;
under ZeRO-3 inside `deepspeed.zero.Init`, which partitions each submodule as it is built), apply
activation checkpointing, split out this rank's pipeline stage, then materialise only what this rank
owns, each tensor from a given state or the model's `initial_value` (a function of the init seed and
the tensor's name: model/init.py). So no rank holds the whole model on the host, and the weights are
a single process's whatever the layout.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from common.deepspeed_import import import_deepspeed
from model import ModelConfig
from model.layers import Block

from .config import RunConfig
from .layout import Layout
from .pipeline import build_pipeline
from .task_model import task_model_builder

Values = Callable[[str, torch.Size], torch.Tensor]


def build_local(
    cfg: RunConfig,
    mcfg: ModelConfig,
    layout: Layout,
    device: torch.device,
    ds_config: dict[str, Any],
    seed: int | None,
    step: int,
    state: dict[str, torch.Tensor] | None = None,
    checkpointing: str = "none",
) -> tuple[nn.Module, nn.Module]:
    """(model, module) with the trainable set of `step`: the plain model, and what the engine wraps
    (the model itself, or this rank's PipelineModule stage). `state` replaces the initial values
    and must hold every tensor this rank owns. `checkpointing`: the activation-checkpointing mode
    (none, selective, full: `auto` is resolved before, pretrain/memory.py); `train.compile` compiles
    each block after it (torchtitan's order)."""
    construct, start_state = task_model_builder(cfg, mcfg, seed)
    zero3 = layout.zero_stage >= 3
    if zero3:
        deepspeed = import_deepspeed()

        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = construct()
    else:
        with torch.device("meta"):
            model = construct()
    model.set_step(step)
    apply_activation_checkpointing(model, checkpointing)
    if cfg.train.compile:
        apply_compile(model)
    values = _values(model, state, start_state)
    names = {id(p): n for n, p in model.named_parameters()}
    fill = functools.partial(materialise, names=names, values=values, device=device)
    if layout.pipeline_stages > 1:
        module = build_pipeline(model, layout.pipeline_stages, cfg.parallel.partition_method, seed, fill)
    else:
        module = model
        if zero3:
            _fill_partitions(model, values)
        else:
            fill(model)
    return model, module


def _values(
    model: nn.Module, state: dict[str, torch.Tensor] | None, start_state: dict[str, torch.Tensor] | None
) -> Values:
    def value(name: str, shape: torch.Size) -> torch.Tensor:
        if state is not None:
            if name not in state:
                raise RuntimeError(f"no tensor {name} in the state to rebuild from")
            return state[name]
        if start_state is not None and name in start_state:
            return start_state[name]
        return model.initial_value(name, shape)

    return value


@torch.no_grad()
def materialise(module: nn.Module, names: dict[int, str], values: Values, device: torch.device) -> None:
    """Allocate every parameter of `module` still on the meta device, on `device`, with its value.
    The Parameter objects stay the same (torch.utils.swap_tensors): ties, requires_grad and
    attributes DeepSpeed set on them carry over."""
    for p in module.parameters():
        if not p.is_meta:
            continue
        value = values(names[id(p)], p.shape)
        if tuple(value.shape) != tuple(p.shape):
            raise RuntimeError(f"{names[id(p)]}: value of shape {tuple(value.shape)} for a tensor of {tuple(p.shape)}")
        fresh = nn.Parameter(value.to(device=device, dtype=p.dtype, copy=True), requires_grad=p.requires_grad)
        fresh.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, fresh)
    if any(b.is_meta for b in module.buffers()):
        raise RuntimeError("a buffer is still on the meta device; materialise buffers too")


@torch.no_grad()
def _fill_partitions(model: nn.Module, values: Values) -> None:
    """ZeRO-3: rank 0 writes each full tensor while it is gathered, and every rank keeps its partition."""
    deepspeed = import_deepspeed()

    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if dist.get_rank() == 0:
                p.data.copy_(values(name, p.shape))


# What `selective` keeps (Korthikanti et al.; torchtitan's op-level policy): the outputs of the matrix
# products and of attention, the costly ops; the norms, RoPE, the MLP's activation and the casts are
# recomputed from them in the backward. Ops outside ATen (the MixiT Triton kernels) are recomputed.
_aten = torch.ops.aten
SELECTIVE_SAVED_OPS = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
    )
)


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> int:
    """Recompute decoder blocks in the backward pass instead of keeping their activations: `full` keeps
    only each block's input, `selective` also the outputs of its matrix products and attention
    (SELECTIVE_SAVED_OPS), `none` leaves the model as it is. Applied from outside the model: each
    block's forward is wrapped in place, so parameter names and the state dict do not change, and every
    argument (attention masks included) passes through. Off where no gradient is taken or with a KV
    cache (decoding). Returns the count of blocks wrapped."""
    if mode == "none":
        return 0
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: none, selective or full")
    context = (
        functools.partial(create_selective_checkpoint_contexts, _selective_policy) if mode == "selective" else None
    )
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.forward = _recomputed(block.forward, context)
    return len(blocks)


def _recomputed(forward: Callable, context: Callable | None) -> Callable:
    kwargs = {} if context is None else {"context_fn": context}

    @functools.wraps(forward)
    def run(h, cos=None, sin=None, cache=None, attn_mask=None):
        if cache is not None or not torch.is_grad_enabled():
            return forward(h, cos, sin, cache, attn_mask)
        return checkpoint(forward, h, cos, sin, None, attn_mask, use_reentrant=False, **kwargs)

    return run


# train.compile's torch.compile backend (the trainer's: inductor; a test may trace with another)
COMPILE_BACKEND = "inductor"


def apply_compile(model: nn.Module) -> int:
    """torch.compile each decoder block in place (`nn.Module.compile`: parameter names and the state dict
    unchanged), around its checkpointing wrapper where there is one. A block the model compiled itself
    (model.compile_blocks) is left as it is. Returns the count of blocks compiled here."""
    blocks = [m for m in model.modules() if isinstance(m, Block) and m._compiled_call_impl is None]
    for block in blocks:
        block.compile(backend=COMPILE_BACKEND)
    return len(blocks)


def resident_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage allocated on this rank: tensors not on the meta device, plus
    ZeRO-3's partitions (`ds_tensor`; a gathered or persisted tensor also counts in full)."""
    total = 0
    for p in model.parameters():
        if not p.is_meta:
            total += p.numel() * p.element_size()
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            total += part.numel() * part.element_size()
    return total


def residency(model: nn.Module, device: torch.device) -> str:
    """One line for the log: parameter bytes resident on each rank (a collective: every rank calls it)."""
    mine = torch.tensor([resident_parameter_bytes(model)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    per_rank = [int(t) for t in every]
    shown = (
        ", ".join(f"{b:,}" for b in per_rank) if len(per_rank) <= 8 else f"min {min(per_rank):,}, max {max(per_rank):,}"
    )
    # the whole model in its current dtype (ZeRO-3: the full shapes)
    whole = sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in model.parameters())
    return f"parameter bytes resident per rank: {shown} (the whole model: {whole:,})"
