"""The per-rank memory estimate and `train.activation_checkpointing: auto`'s choice from it.

The estimate counts weights, gradients, optimizer state (as ZeRO shards them), the activations each
checkpointing mode keeps, DeepSpeed's communication buffers, MixiT's cached matrices or tiles, and the
optimizer step's fp32 copy of the gradients. The activations are counted tensor by tensor from what
autograd saves in one block (`layer_activation_bytes`); tests/test_memory_estimate.py checks those counts
against the bytes a CPU forward leaves allocated, and the totals against the peaks measured on a GPU
(docs/data/gpu). `auto` takes the mode with the least recomputation whose total fits the device.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from model import ModelConfig
from model.kernels.select import mixit_backend, mixit_dense_bytes, mixit_streamed_bytes
from model.transformer import Transformer

from .config import RunConfig
from .layout import Layout

# Cheapest recomputation first: `auto` takes the first whose estimate fits.
CHECKPOINTING_MODES = ("none", "selective", "full")
# `auto`'s budget: this share of the device's memory. The rest covers the estimate's error (within 10 %
# of every measured GPU peak: tests/test_memory_estimate.py) and the allocator's fragmentation.
AUTO_MEMORY_FRACTION = 0.85

# DeepSpeed's zero_optimization defaults for the sizes a template may leave out (deepspeed/runtime/zero/config.py)
ZERO_DEFAULTS = {
    "reduce_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
}


def comm_buffer_bytes(zero: dict[str, Any], stage: int, wb: int, gb: int) -> float:
    """Bytes of DeepSpeed's communication buffers on one rank, as DeepSpeed 0.19 allocates them: ZeRO-1/2
    copy gradients into a reduce_bucket_size buffer (contiguous_gradients), two with overlap_comm (one
    fills while the other is reduced); ZeRO-3 keeps one such buffer and gathers up to
    stage3_prefetch_bucket_size parameters ahead of their use. allgather_bucket_size only cuts ZeRO-1/2's
    all-gather of the updated weights into pieces, which land in the weights' own memory."""
    if stage == 0:
        return 0.0
    size = lambda key: float(zero.get(key, ZERO_DEFAULTS[key]))  # noqa: E731
    overlap = zero.get("overlap_comm", stage == 3)  # DeepSpeed turns it on by default for ZeRO-3 only
    reduce = size("reduce_bucket_size") * gb if zero.get("contiguous_gradients", True) else 0.0
    if stage < 3:
        return reduce * (2 if overlap else 1)
    return reduce + size("stage3_prefetch_bucket_size") * wb


def layer_activation_bytes(
    mcfg: ModelConfig, mode: str, element_bytes: int, mixit_impl: str = "dense", kv_copies=False
):
    """Bytes one decoder block keeps per token for its backward under checkpointing `mode`, activations in
    `element_bytes` (2: bf16, 4: fp32). What model/layers.py's autograd saves, per token:
    - none: each RMSNorm its fp32 input (4d) and two d-wide outputs (normalised; times its gain: the next
      projection's input); softmax attention q and k after RoPE, v (kv wide, d with `kv_copies`: GQA's
      heads repeated for SDPA), its output (which o_proj reads) and its fp32 log-sum-exp (4 B per head);
      MixiT the o_proj input (its fixed A needs nothing of V for dV = A^T dO); the MLP its gate,
      activation, up and their product (4f);
    - selective: the block's input and the outputs of the products and attention (pretrain/parallelize.py
      SELECTIVE_SAVED_OPS): q, k, v, attention, o_proj, gate, up, down; MixiT's dense path its batched
      product (its other paths are recomputed);
    - full: the block's input.
    Besides, a checkpointed block keeps the RNG state (constant per block: 5,056 B on the CPU). Shaped
    attention's extra terms are not counted."""
    d, f, heads = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_heads
    kv = d if kv_copies else mcfg.num_kv_heads * mcfg.head_dim
    e = element_bytes
    dense = d if mixit_impl == "dense" else 0  # selective: the batched product's output
    if mode == "full":
        return e * d
    if mcfg.mixer == "mixit":
        if mode == "selective":
            return e * (3 * d + mcfg.num_kv_heads * mcfg.head_dim + 2 * f + dense)
        return 8 * d + e * (5 * d + 4 * f) + 8
    if mode == "selective":
        return e * (5 * d + 2 * mcfg.num_kv_heads * mcfg.head_dim + 2 * f) + 4 * heads
    return 8 * d + e * (4 * d + 2 * d + 2 * kv + 4 * f) + 4 * heads + 8


def loss_bytes(mcfg: ModelConfig, tokens: int, element_bytes: int, weight_bytes: int) -> tuple[float, float]:
    """(kept until the backward, transient at the forward's end) of the final norm and the loss for `tokens`
    tokens: the norm's fp32 input and output, the chunked loss's input gradient and head gradient (computed in
    its forward: kernels/loss.py) and, while it runs, its fp32 head gradient and its one (chunk, vocab) fp32
    buffer; with loss_chunk_tokens=0 the full fp32 logits and their gradient."""
    d, v, e = mcfg.hidden_size, mcfg.vocab_size, element_bytes
    norm = tokens * (4 * d + e * d + 4)
    if not mcfg.loss_chunk_tokens:
        return norm, tokens * v * 4 * 2
    kept = norm + tokens * e * d + v * d * weight_bytes
    return kept, min(tokens, mcfg.loss_chunk_tokens) * v * 4 + v * d * 4


def mixit_paths(mcfg: ModelConfig, element_bytes: int, device_type: str, device_memory: int | None) -> list[str]:
    """The MixiT path of each layer (kernels/select.py's rule; none for other mixers); on CUDA with the
    device's memory unknown, the tiles (causal) or the dense matrices (bidirectional): the rule's choice
    where they fit."""
    c = mcfg
    if c.mixer != "mixit":
        return []
    if device_type == "cuda" and device_memory is None:
        return [("streamed" if c.causal else "dense") if c.mixit_impl == "auto" else c.mixit_impl] * c.num_layers
    dense = mixit_dense_bytes(c.num_heads, c.num_layers, c.max_seq_len, element_bytes)
    tiles = mixit_streamed_bytes(c.num_heads, c.num_layers, c.max_seq_len, element_bytes, c.causal)
    device = torch.device(device_type)
    return [
        mixit_backend(c.mixit_impl, c.max_seq_len, device, dense, device_memory, tiles, c.causal, i, c.num_layers)[0]
        for i in range(c.num_layers)
    ]


def mixit_cache_bytes(mcfg: ModelConfig, element_bytes: int, paths: list[str]) -> float:
    """Bytes MixiT keeps cached per device with each layer on its path: its dense matrices or its stored tiles."""
    c, per = mcfg, {}
    if paths:
        per["dense"] = mixit_dense_bytes(c.num_heads, 1, c.max_seq_len, element_bytes)
        per["streamed"] = mixit_streamed_bytes(c.num_heads, 1, c.max_seq_len, element_bytes, c.causal)
    return float(sum(per.get(path, 0) for path in paths))


def memory_estimate(
    cfg: RunConfig,
    layout: Layout,
    mcfg: ModelConfig,
    n_trainable: int,
    n_frozen: int,
    zero: dict[str, Any] | None = None,
    n_persistent: int = 0,
    checkpointing: str | None = None,
    device_type: str = "cpu",
    device_memory: int | None = None,
) -> dict[str, float]:
    """Rough bytes per rank (GiB), by part, and their peak `total`.

    fp32 training: 4 B weights + 4 B grads + 8 B Adam moments per trainable parameter.
    bf16 training: 2 B weights + 2 B grads (4 B under pipeline fp32 accumulation) + 4 B fp32
    master + 8 B moments, and during the optimizer step DeepSpeed's fp32 copy of the gradients
    (`step_copy`, 4 B, sharded as the optimizer state). Frozen tensors: weights only. ZeRO-1 shards the
    optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the weights, over the data-parallel ranks;
    pipeline stages split everything by the stage count. Under ZeRO-3 the `n_persistent` parameters of
    tensors at or under stage3_param_persistence_threshold stay whole on every rank. Activations: each
    block's saved tensors under `checkpointing` (default the recipe's; `layer_activation_bytes`) for the
    micro-batches in flight, the final norm's and the loss's (`loss_bytes`), and while one block is
    recomputed in the backward its full set; MixiT's cached matrices or tiles on the path each layer takes
    on the device (`mixit_cache`). The peak `total` is the fixed parts plus the larger of the activations and the
    optimizer step's copy.
    """
    bf16 = cfg.train.precision == "bf16"
    wb = 2 if bf16 else 4
    gb = 4 if (bf16 and layout.pipeline_stages > 1) or not bf16 else 2
    ob = 12 if bf16 else 8
    dp, pp = layout.data_parallel, layout.pipeline_stages
    st = layout.zero_stage
    weights = (n_trainable + n_frozen - n_persistent) * wb / pp / (dp if st >= 3 else 1) + n_persistent * wb / pp
    grads = n_trainable * gb / pp / (dp if st >= 2 else 1)
    optim = n_trainable * ob / pp / (dp if st >= 1 else 1)
    step_copy = n_trainable * 4 / pp / (dp if st >= 1 else 1) if bf16 else 0.0
    if layout.offload_optimizer:
        optim = step_copy = 0.0
    if layout.offload_param:
        weights = 0.0
    mode = checkpointing or cfg.train.activation_checkpointing
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"checkpointing {mode!r}: estimate each mode (estimates_by_mode) and choose from them")
    tokens = cfg.train.seq_len * layout.micro_batch
    paths = mixit_paths(mcfg, wb, device_type, device_memory)
    impl = paths[0] if paths else "none"
    kv_copies = device_type == "cuda" and getattr(cfg.data, "return_doc_ids", False)  # masked SDPA: K/V repeated
    layer = layer_activation_bytes(mcfg, mode, wb, impl, kv_copies) * tokens
    recompute = 0.0 if mode == "none" else layer_activation_bytes(mcfg, "none", wb, impl, kv_copies) * tokens
    in_flight = min(pp, layout.grad_accum) if pp > 1 else 1
    kept, transient = loss_bytes(mcfg, tokens, wb, wb)
    saved = (layer * mcfg.num_layers / pp + kept) * in_flight
    acts = saved + max(transient, recompute)
    parts = {
        "weights": weights,
        "grads": grads,
        "optimizer": optim,
        "activations": acts,
        "mixit_cache": mixit_cache_bytes(mcfg, wb, paths) / pp,
        "comm_buffers": comm_buffer_bytes(zero or {}, st, wb, gb),
        "step_copy": step_copy,
    }
    total = sum(v for k, v in parts.items() if k not in ("activations", "step_copy")) + max(acts, step_copy)
    return {f"{k}_gib": v / 1024**3 for k, v in {**parts, "total": total}.items()}


def parameter_counts(mcfg: ModelConfig, zero_stage: int, persistence_threshold: float) -> tuple[int, int, int]:
    """(trainable, frozen, kept whole under ZeRO-3) parameter counts at step 0, from a model on the meta device."""
    with torch.device("meta"):
        model = Transformer(mcfg)
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    persistent = sum(p.numel() for p in params if p.numel() <= persistence_threshold) if zero_stage == 3 else 0
    return trainable, total - trainable, persistent


def estimates_by_mode(
    cfg: RunConfig,
    layout: Layout,
    mcfg: ModelConfig,
    zero: dict[str, Any],
    device_type: str,
    device_memory: int | None = None,
) -> dict[str, dict[str, float]]:
    """`memory_estimate` under each checkpointing mode."""
    keep = zero.get("stage3_param_persistence_threshold", ZERO_DEFAULTS["stage3_param_persistence_threshold"])
    trainable, frozen, persistent = parameter_counts(mcfg, layout.zero_stage, keep)
    return {
        mode: memory_estimate(cfg, layout, mcfg, trainable, frozen, zero, persistent, mode, device_type, device_memory)
        for mode in CHECKPOINTING_MODES
    }


def choose_checkpointing(totals_gib: dict[str, float], device_memory: int) -> tuple[str, str]:
    """(mode, reason): the first of CHECKPOINTING_MODES whose estimated total fits AUTO_MEMORY_FRACTION of
    the device's memory; `full` when none does (it needs the least)."""
    budget = AUTO_MEMORY_FRACTION * device_memory / 2**30
    said = []
    for mode in CHECKPOINTING_MODES:
        fits = totals_gib[mode] <= budget
        said.append(f"{mode} {totals_gib[mode]:.1f} GiB")
        if fits:
            return (
                mode,
                f"auto: {', '.join(said)} of a {budget:.1f} GiB budget ({AUTO_MEMORY_FRACTION:.0%} of the device)",
            )
    return "full", f"auto: no mode fits a {budget:.1f} GiB budget ({', '.join(said)}); full needs the least"


def device_memory_bytes(device: torch.device) -> int:
    """The device's memory: a GPU's total, or on the CPU the host's physical memory over the ranks sharing it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1)


def resolve_checkpointing(
    cfg: RunConfig, mcfg: ModelConfig, layout: Layout, zero: dict[str, Any], device: torch.device
) -> tuple[str, str, float]:
    """(the mode this run applies, why, its estimated peak GiB per rank): the recipe's mode, or under `auto`
    the cheapest that fits the device."""
    memory = device_memory_bytes(device)
    by_mode = estimates_by_mode(cfg, layout, mcfg, zero, device.type, memory)
    mode, reason = cfg.train.activation_checkpointing, "train.activation_checkpointing"
    if mode == "auto":
        mode, reason = choose_checkpointing({m: e["total_gib"] for m, e in by_mode.items()}, memory)
    return mode, reason, by_mode[mode]["total_gib"]
