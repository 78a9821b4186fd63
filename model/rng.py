"""Counter-based random numbers (Philox-4x32-10), bit-compatible with Triton's `tl.randn`.

MixiT's mixing matrix entry M_h[i, j] is a pure function of (seed, layer, head, i, j).
Computing it from a counter, not from a sequential generator, means that:
  * any device regenerates the same matrix from the config seed (nothing stored);
  * any block of the matrix can be produced on its own (memory-light paths);
  * a Triton kernel calling `tl.randn(key, i * T + j)` draws exactly these numbers,
    so the dense reference and the fused kernel can be compared on CPU.

uint32 arithmetic is emulated in int64 tensors (PyTorch lacks uint32 multiply).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's uint_to_uniform_float scale for 32-bit ints


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b) >> 32 and (a * b) & 0xffffffff for a constant a < 2**32 and b < 2**32, in int64."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return hi, lo


def philox(key: int, c0: torch.Tensor, c1: torch.Tensor | int = 0, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 of counters (c0, c1, 0, 0) under a 64-bit key; returns four uint32 words (int64 tensors)."""
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    c0 = c0.to(torch.int64) & _MASK32
    c1 = torch.as_tensor(c1, dtype=torch.int64, device=c0.device).expand_as(c0) & _MASK32
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def _to_uniform(x: torch.Tensor) -> torch.Tensor:
    """Triton's uint_to_uniform_float for 32-bit words: [0, 1) in float32."""
    x = torch.where(x >= 2**31, x - 2**32, x)  # reinterpret as int32
    x = torch.where(x < 0, -x - 1, x)  # ~x
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def _box_muller(w0: torch.Tensor, w1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton's pair_uniform_to_normal of two 32-bit words: (r cos theta, r sin theta)."""
    u1 = torch.clamp(_to_uniform(w0), min=1.0e-7)
    theta = torch.tensor(6.283185307179586, dtype=torch.float32) * _to_uniform(w1)
    r = torch.sqrt(-2.0 * torch.log(u1))
    return r * torch.cos(theta), r * torch.sin(theta)


def randn(key: int, offsets: torch.Tensor) -> torch.Tensor:
    """N(0, 1) float32 samples equal to Triton's `tl.randn(key, offsets)` (Box-Muller, first output)."""
    w0, w1, _, _ = philox(key, offsets)
    return _box_muller(w0, w1)[0]


def randn4x(key: int, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Four N(0, 1) float32 samples per counter, equal to Triton's `tl.randn4x(key, counters)`: one
    Philox call gives four words, Box-Muller turns each pair into two normals."""
    w0, w1, w2, w3 = philox(key, counters)
    return (*_box_muller(w0, w1), *_box_muller(w2, w3))


def matrix_normals(key, rows: torch.Tensor, cols: torch.Tensor, T: int, generator: str = "philox") -> torch.Tensor:
    """z[i, j] for i in rows, j in cols of one matrix with row stride T (float32, shape (rows, cols));
    `key` is an int, or a tensor of keys that broadcasts against that shape (one matrix per key).

    `generator` (the model's `mixit_rng`): "philox" is tl.randn at counter i*T + j, one Philox call
    per entry; "philox4x" is tl.randn4x at counter i*ceil(T/4) + j//4, lane j % 4, so four
    consecutive entries of a row come from one call: a quarter of the generator's work."""
    rows, cols = rows.to(torch.int64), cols.to(torch.int64)
    if generator == "philox":
        return randn(key, rows[:, None] * T + cols[None, :])
    if generator != "philox4x":
        raise ValueError(f"unknown generator {generator!r}; choose philox or philox4x")
    quads, column_quad = torch.unique(cols >> 2, return_inverse=True)  # one Philox call per quad, not per column
    z4 = torch.stack(randn4x(key, rows[:, None] * ((T + 3) // 4) + quads[None, :]), dim=-1)  # (..., rows, quads, 4)
    return z4[..., column_quad, cols & 3]


def uniform(key: int, offsets: torch.Tensor, stream: int = 1) -> torch.Tensor:
    """U[0, 1) float32 samples from counter (offset, stream); stream 0 is what randn uses."""
    w0, _, _, _ = philox(key, offsets, stream)
    return _to_uniform(w0)


def mixit_key(seed: int, layer: int, head: int) -> int:
    """The 64-bit Philox key of one (layer, head) matrix: low word = seed, high word = layer/head."""
    if not (0 <= seed < 2**32 and 0 <= layer < 2**16 and 0 <= head < 2**16):
        raise ValueError(f"mixit key out of range: seed={seed} layer={layer} head={head}")
    return seed | (((layer << 16) | head) << 32)
