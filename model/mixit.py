"""MixiT: attention replaced by a fixed random mixing matrix (VARIANTS.md, exact).

Per layer and head h >= 1, with T = max_seq_len and d_h the head dim:
    sigma_h = 1/sqrt(T d_h) + u_h (1/sqrt(T) - 1/sqrt(T d_h))     u_h ~ U[0, 1)
    M_h[i, j] = sigma_h * z(seed, layer, h, i, j),  z ~ N(0, 1)  (counter-based, model/rng.py;
                                                     `mixit_rng` says which counter draws each entry)
    drift_h[i] = mean of M_h[i, j] over the entries the row averages (j <= i when causal)
    A_h = I + beta (M_h - drift_h 1^T), restricted to the causal triangle
so each causal row of A_h sums to 1. Head 0 is a sink head: A_0[i, i] = A_0[i, 0] = 1/2.
The `depth_alpha != 0` path uses sigma = 1/sqrt(T) for every head and no identity term.

Unlike the reference code, the matrix is regenerated on the model's device from the
config seed (never stored in checkpoints), any length t <= T is the leading t x t block
(causal), and bidirectional centering divides by the number of entries averaged (t).
"""

from __future__ import annotations

import math

import torch

from common.errors import ConfigError

from .config import ModelConfig
from .rng import matrix_normals, mixit_key, uniform


def head_sigmas(cfg: ModelConfig, layer: int) -> torch.Tensor:
    """sigma_h for every head of one layer (float64, on CPU: H numbers)."""
    T, dh = cfg.max_seq_len, cfg.head_dim
    if cfg.mixit_depth_alpha != 0:
        return torch.full((cfg.num_heads,), 1.0 / math.sqrt(T), dtype=torch.float64)
    u = torch.stack(
        [
            uniform(mixit_key(cfg.mixit_seed, layer, h), torch.zeros(1, dtype=torch.int64))[0]
            for h in range(cfg.num_heads)
        ]
    ).double()
    lo, hi = 1.0 / math.sqrt(T * dh), 1.0 / math.sqrt(T)
    return lo + u * (hi - lo)


def raw_block(
    cfg: ModelConfig, layer: int, head: int, rows: torch.Tensor, cols: torch.Tensor, sigma: float
) -> torch.Tensor:
    """sigma * z[i, j] for i in rows, j in cols (float32), without masking: any block, any device."""
    key = mixit_key(cfg.mixit_seed, layer, head)
    return matrix_normals(key, rows, cols, cfg.max_seq_len, cfg.mixit_rng) * sigma


# entries of one row block while the dense matrix is built: the generator's int64 temporaries of a
# whole T x T head (8 GiB each at T = 32768) do not fit beside the matrix on a GPU
BUILD_BLOCK_ENTRIES = 1 << 22


def mixing_matrix(
    cfg: ModelConfig,
    layer: int,
    t: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The dense mixing matrices A of one layer, shape (H, t, t) (the reference path).

    Computed in float32 a block of rows at a time and stored in `dtype`, so that building it needs
    little beyond the matrix itself."""
    t = cfg.max_seq_len if t is None else t
    if not 1 <= t <= cfg.max_seq_len:
        raise ConfigError(f"sequence length {t} is outside [1, max_seq_len={cfg.max_seq_len}]")
    idx = torch.arange(t, device=device)
    sigmas = head_sigmas(cfg, layer)
    out = torch.zeros(cfg.num_heads, t, t, device=device, dtype=dtype)
    sink = out[0]
    sink[idx, idx] = 0.5
    sink[:, 0] = 0.5
    step = max(1, BUILD_BLOCK_ENTRIES // t)
    for r in range(0, t, step):
        rows = idx[r : r + step]
        seen = rows[:, None] >= idx[None, :] if cfg.causal else torch.ones(1, t, dtype=torch.bool, device=device)
        count = seen.sum(dim=1, keepdim=True).to(torch.float32)  # entries averaged per row
        for h in range(1, cfg.num_heads):
            m = raw_block(cfg, layer, h, rows, idx, float(sigmas[h])) * seen
            a = cfg.mixit_beta * (m - m.sum(dim=1, keepdim=True) / count)
            if cfg.mixit_depth_alpha == 0:
                a[torch.arange(len(rows), device=device), rows] += 1.0
            out[h, r : r + step] = a * seen
    return out


def branch_scale(cfg: ModelConfig) -> float:
    """Residual-branch multiplier of the depth_alpha path: (L_base / L) ** alpha (1 otherwise)."""
    if cfg.mixer != "mixit" or cfg.mixit_depth_alpha == 0:
        return 1.0
    return (cfg.mixit_depth_base_layers / cfg.num_layers) ** cfg.mixit_depth_alpha
