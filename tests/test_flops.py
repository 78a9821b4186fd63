"""FLOP accounting: the textbook formula for `standard`, the derived savings, and a FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model import VARIANTS, preset
from model.config import ModelConfig
from model.flops import flops_per_token
from model.transformer import build_model


def standard_formula(cfg: ModelConfig, seq_len: int) -> float:
    """6N + 12 L t d with N the matmul weights (head included): the textbook count for `standard`."""
    d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    n = cfg.num_layers * (2 * d * d + 2 * d * kv + 3 * d * cfg.intermediate_size) + d * cfg.vocab_size
    return 6 * n + 12 * cfg.num_layers * seq_len * d


def test_standard_equals_6n_plus_attention():
    for name in ("tiny", "s", "1b"):
        cfg = preset(name, vocab_size=1000)
        for t in (64, 2048):
            assert flops_per_token(cfg, t)["train"] == standard_formula(cfg, t)


def test_variant_savings_match_derivation():
    cfg = preset("s", vocab_size=1000)
    d, kv, f, L, t = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.num_layers, 256
    std = flops_per_token(cfg, t)["train"]
    pq, pk = d * d, d * kv
    assert std - flops_per_token(cfg.replace(variant="frozen_qk"), t)["train"] == L * 2 * (pq + pk)
    assert std - flops_per_token(cfg.replace(variant="frozen_mlp"), t)["train"] == L * 2 * 3 * d * f
    assert std - flops_per_token(cfg.replace(variant="mixit"), t)["train"] == L * (6 * (pq + pk) + 8 * t * d)
    # a schedule that unfreezes Q/K at step 10 costs `standard` from then on
    sched = cfg.replace(variant="frozen_qk", freeze_schedule=[[10, []]])
    assert flops_per_token(sched, t, step=10)["train"] == std


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_accounting_equals_measured_flop_counter(variant):
    """torch's FLOP counter over a real forward+backward sees exactly the counted work:
    frozen weights cost no weight-gradient matmuls, MixiT no Q/K and no dA."""
    t = 32
    cfg = preset("tiny", variant=variant, vocab_size=128, max_seq_len=t, attn_impl="eager")
    model = build_model(cfg, seed=0)
    x = torch.randint(0, 128, (2, t))
    counter = FlopCounterMode(display=False)
    with counter:
        model(x, labels=x).backward()
    assert counter.get_total_flops() == flops_per_token(cfg, t)["train"] * x.numel()
