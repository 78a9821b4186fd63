"""The one MFU definition, shared by the trainer (pretrain/metrics.py, loop.py) and
benchmarks/bench_model.py: achieved training FLOP/s per device (model/flops.py) over the device's
peak, which is, in this order, `configured` (logging.peak_tflops), `measured` (the best of a few large
square matmuls, when logging.measure_peak asks), `table:NAME` (the data-sheet dense bf16 figure for
the GPU's name), else unknown (no MFU). Every MFU is logged with its peak's source (docs/TRAINING.md).
"""

from __future__ import annotations

import time

import torch

# Dense bf16 peak TFLOP/s per device: the vendor data sheet's BF16 Tensor Core figure without sparsity
# (NVIDIA prints Hopper's with 2:4 sparsity, twice the dense rate). The first name found in the device
# name wins, so a form factor's entry comes before its family's.
#   NVIDIA H100 Tensor Core GPU data sheet: H100 SXM 1,979 (sparse) -> 989; H100 NVL 1,671 -> 835;
#     H100 PCIe 1,513 -> 756 (torch names: "NVIDIA H100 80GB HBM3" is the SXM, "NVIDIA H100 PCIe", "NVIDIA H100 NVL")
#   NVIDIA H200 Tensor Core GPU data sheet: H200 SXM 1,979 (sparse) -> 989; H200 NVL 1,671 -> 835
#     (torch: "NVIDIA H200", "NVIDIA H200 NVL")
#   NVIDIA A100 Tensor Core GPU data sheet: BF16 312 dense (624 sparse), SXM and PCIe alike
PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "V100": 125.0,
    "MI300X": 1307.0,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_tflops(
    device: torch.device, dtype: torch.dtype | None = None, n: int | None = None, repeats: int = 5
) -> float:
    """Best of `repeats` timings of three n x n matmuls: the device's attainable peak for `dtype`
    (default bf16 on CUDA at n 8192, float32 on CPU at n 2048)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    n = n or (8192 if cuda else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / 3)
    return 2 * n**3 / best / 1e12


def table_peak_tflops(device_name: str) -> tuple[float | None, str]:
    """(data-sheet peak, 'table:NAME') for a GPU name, or (None, 'unknown')."""
    for name, tflops in PEAK_TFLOPS.items():
        if name in device_name:
            return tflops, f"table:{name}"
    return None, "unknown"


def peak_tflops(configured: float | None, measure: bool, device: torch.device) -> tuple[float | None, str]:
    """(peak TFLOP/s per device, its source) in the module docstring's order."""
    device = torch.device(device)
    if configured:
        return float(configured), "configured"
    if measure:
        return measure_matmul_tflops(device), "measured"
    if device.type == "cuda":
        return table_peak_tflops(torch.cuda.get_device_name(device))
    return None, "unknown"


def mfu(tflops_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved TFLOP/s per device over the peak (None when no peak is known)."""
    return tflops_per_device / peak if peak else None
