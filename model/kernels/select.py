"""Run-time choice of the attention and MixiT backends, logged once per distinct choice (the rules:
docs/PERFORMANCE.md's implementations table)."""

from __future__ import annotations

import logging

import torch

from .flash import flash_available
from .mixit_streamed import TILE, tile_count
from .mixit_triton import triton_available

log = logging.getLogger("model.kernels")

# Dense A costs H * T^2 * 4 bytes per layer and device (4 heads at T = 1024: 16 MiB), cached
# for the life of the model; above this length the memory-light blocked path is used instead.
MIXIT_DENSE_MAX_T = 1024
# On CUDA: the dense matrices of all layers (H * T^2 * element bytes each, in the compute dtype)
# may take this share of the device's memory; the 1b preset needs 4 GiB at T 2048 in bf16, 64 GiB at
# T 8192. Half, because dense is the fast path wherever it fits: on an H200 the 1b step at T 8192 ran
# 2.7x faster dense than with the Triton kernel, peaking at 90 of the 140 GiB (docs/PERFORMANCE.md).
MIXIT_DENSE_MEMORY_FRACTION = 0.5
# On CUDA: the stored tiles of M of all layers (heads 1..H-1, the 64 x 64 tiles on and below the diagonal,
# in the compute dtype: kernels/mixit_streamed.py) may take this share of the device's memory: 31 GiB for
# the 1b preset at T 8192 in bf16. Half, as for the dense matrices and for the same measurement: the 1b
# step at T 8192 peaked at 90 of 140 GiB beside 64 GiB of cached matrices, so the rest of a step fits in
# the other half; above it the Triton kernel regenerates each tile (about ten times a tile's read time).
MIXIT_STREAMED_MEMORY_FRACTION = 0.5

_logged: set[tuple] = set()


def log_choice(kind: str, choice: str, reason: str) -> None:
    """Log `kind: choice (reason)` the first time this (kind, choice, reason) is seen."""
    key = (kind, choice, reason)
    if key not in _logged:
        _logged.add(key)
        log.info("%s backend: %s (%s)", kind, choice, reason)


def attention_backend(
    attn_impl: str, q: torch.Tensor, attn_mask: torch.Tensor | None, past: int, record_attn: bool = False
) -> tuple[str, str]:
    """(backend, reason) for one softmax-attention call: 'eager', 'flash', 'flash_varlen' or 'sdpa'."""
    if record_attn:
        return "eager", "attention maps are being recorded"
    if attn_impl == "eager":
        return "eager", "attn_impl=eager"
    if attn_impl == "sdpa":
        return "sdpa", "attn_impl=sdpa"
    if attn_impl == "flash":
        return ("flash" if attn_mask is None else "flash_varlen"), "attn_impl=flash"
    # auto
    if not q.is_cuda:
        return "sdpa", "not on CUDA"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "sdpa", f"dtype {q.dtype} (flash-attn needs fp16/bf16)"
    if past:
        return "sdpa", "incremental decoding with a KV cache"
    if not flash_available():
        return "sdpa", "flash-attn not installed"
    if attn_mask is None:
        return "flash", "CUDA, half precision, flash-attn installed"
    return "flash_varlen", "packed documents, flash-attn installed"


def sdpa_native_gqa(q: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether SDPA takes K and V with fewer heads than Q itself (`enable_gqa`) for this call, instead of
    copies repeated to Q's heads: on the CPU always (its flash kernel reads the shared heads); on CUDA
    only where the flash kernel takes the call (fp16/bf16, no mask, head dim <= 256), because elsewhere
    `enable_gqa` falls back to the unfused math kernel, slower than the copies."""
    if not q.is_cuda:
        return True
    return q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and q.shape[-1] <= 256


def mixit_dense_bytes(num_heads: int, num_layers: int, max_seq_len: int, element_bytes: int) -> int:
    """Bytes the dense mixing matrices of every layer hold on one device (the dense path's cache)."""
    return num_layers * num_heads * max_seq_len**2 * element_bytes


def mixit_streamed_bytes(num_heads: int, num_layers: int, max_seq_len: int, element_bytes: int, causal: bool) -> int:
    """Bytes the stored tiles of every layer hold on one device (the streamed path's cache)."""
    return num_layers * (num_heads - 1) * tile_count(max_seq_len, causal) * TILE * TILE * element_bytes


def _fits(what: str, nbytes: int | None, fraction: float, device_memory: int) -> tuple[bool, str]:
    """(nbytes fit in fraction of the device, the comparison in words)."""
    budget = int(fraction * device_memory)
    if nbytes is None:
        return False, f"{what} size unknown"
    sign = "<=" if nbytes <= budget else ">"
    return nbytes <= budget, f"{what} {nbytes / 2**30:.2f} GiB {sign} {budget / 2**30:.2f} GiB of the device"


def mixit_backend(
    mixit_impl: str,
    max_seq_len: int,
    device: torch.device,
    dense_bytes: int | None = None,
    device_memory: int | None = None,
    streamed_bytes: int | None = None,
    causal: bool = True,
    layer: int = 0,
    num_layers: int = 1,
) -> tuple[str, str]:
    """(impl, reason) for MixiT mixing in layer `layer` of `num_layers`: 'dense', 'blocked', 'triton' or
    'streamed'.

    On CUDA `dense_bytes` and `streamed_bytes` (mixit_dense_bytes and mixit_streamed_bytes of the model's
    `num_layers` layers) are compared with the device's memory (`device_memory`, default: the device's
    total), so the rule can be evaluated for any device size. Causal: the stored tiles wherever they fit;
    they are the dense matrix's nonzero half, read once per group of sequences with the tiles above the
    diagonal skipped, where dense's batched product reads and multiplies the whole square. Bidirectional:
    the tiles are the whole square too, as many bytes as the dense matrices, so dense (one cuBLAS product)
    keeps the sizes where it fits, and the tiles take over above it. Where neither fits for every layer,
    the leading layers whose tiles fit stream and the others regenerate (the tiles chunked by layer: the
    1b preset at T 16,384, 124.5 GiB of bf16 tiles, streams 8 of its 16 layers on a 141 GB card).
    """
    if mixit_impl != "auto":
        return mixit_impl, f"mixit_impl={mixit_impl}"
    if torch.device(device).type == "cuda":
        if device_memory is None:
            device_memory = torch.cuda.get_device_properties(device).total_memory
        dense_fits, dense_size = _fits("dense matrices", dense_bytes, MIXIT_DENSE_MEMORY_FRACTION, device_memory)
        tiles_fit, tiles_size = _fits("stored tiles", streamed_bytes, MIXIT_STREAMED_MEMORY_FRACTION, device_memory)
        if not triton_available():
            return ("dense", dense_size) if dense_fits else ("blocked", f"CUDA without Triton, {dense_size}")
        if dense_fits and not causal:
            return "dense", f"bidirectional, {dense_size}"
        if tiles_fit:
            return "streamed", f"CUDA with Triton, {tiles_size}"
        if dense_fits:  # short T only, where padding to whole tiles outweighs the half the triangle saves
            return "dense", dense_size
        budget = MIXIT_STREAMED_MEMORY_FRACTION * device_memory
        per_layer = streamed_bytes / num_layers if streamed_bytes else None
        leading = min(num_layers, int(budget // per_layer)) if per_layer else 0
        if layer < leading:
            return "streamed", (
                f"CUDA with Triton, the stored tiles of the first {leading} of {num_layers} layers: "
                f"{leading * per_layer / 2**30:.2f} GiB <= {budget / 2**30:.2f} GiB of the device"
            )
        if leading:
            return "triton", f"CUDA with Triton, layers from {leading}: {tiles_size} for all {num_layers}"
        return "triton", f"CUDA with Triton, {tiles_size}"
    if max_seq_len <= MIXIT_DENSE_MAX_T:
        return "dense", f"max_seq_len {max_seq_len} <= {MIXIT_DENSE_MAX_T}"
    return "blocked", f"max_seq_len {max_seq_len} > {MIXIT_DENSE_MAX_T}"
