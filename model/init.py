"""Initial weights by name: each tensor's initial value depends on the init seed and its own name only.

A sequential generator (seed once, then draw every tensor in turn) makes a tensor's value depend
on every tensor drawn before it, so a rank could only reproduce its share by drawing the whole
model. Here each tensor draws from its own CPU generator seeded from (init seed, name): any rank
materialises just the tensors (or the ZeRO-3 partitions) it owns, on any device, and gets the
values a single process would have.
"""

from __future__ import annotations

import hashlib

import torch


def draw_seed() -> int:
    """An init seed from torch's global CPU generator (so `torch.manual_seed` still fixes the model)."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def normal(shape, std: float, seed: int, name: str) -> torch.Tensor:
    """N(0, std) fp32 on the CPU, drawn from a CPU generator seeded from (seed, name) by SHA-256 (stable
    across processes and Python runs)."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.empty(tuple(shape), dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)


# Matrices whose two dimensions both grow with the width: µP (model.parametrization: mup) scales their
# initial std by 1/sqrt(m) and their Adam rate by 1/m (pretrain/engine.py's param groups).
HIDDEN_MATRICES = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight")
HIDDEN_MATRICES += (".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


def is_hidden_matrix(name: str) -> bool:
    return name.endswith(HIDDEN_MATRICES)
