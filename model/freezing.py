"""One freezing mechanism for every variant: named parameter groups.

Each parameter belongs to one or more groups (a query projection is in `qk` and
`blocks`); a parameter is frozen when any of its groups is frozen. Variants,
explicit overrides and freeze/unfreeze schedules all reduce to a set of frozen
groups (ModelConfig.frozen_groups_at), applied here by setting requires_grad.
Frozen tensors then get no gradient, and the trainer gives them no optimizer
state and no data-parallel reduction (DeepSpeed only manages requires_grad tensors).
"""

from __future__ import annotations

import re

from torch import nn

_LAYER_RULES = [
    (re.compile(r"self_attn\.(q_proj|k_proj)\."), "qk"),
    (re.compile(r"self_attn\.v_proj\."), "v"),
    (re.compile(r"self_attn\.o_proj\."), "o"),
    (re.compile(r"mlp\."), "mlp"),
    (re.compile(r"(input_layernorm|post_attention_layernorm)\."), "norms"),
]


def groups_of(name: str, tied: bool = False) -> set[str]:
    """The parameter groups of a parameter name of model.Transformer (or its HF-style names)."""
    name = name.removeprefix("model.")
    if name.startswith("layers.") or ".layers." in name:
        for pattern, group in _LAYER_RULES:
            if pattern.search(name):
                return {group, "blocks"}
        return {"blocks"}
    if name.startswith(("embed_tokens.", "embed_positions.")):
        return {"embeddings", "head"} if tied and name.startswith("embed_tokens.") else {"embeddings"}
    if name.startswith("lm_head."):
        return {"embeddings", "head"} if tied else {"head"}
    if name.startswith("norm."):
        return {"norms"}
    if name.startswith(("score.", "classifier.")):
        return {"head"}
    return set()


def apply_freeze(model: nn.Module, frozen_groups: set[str], tied: bool = False) -> list[str]:
    """Set requires_grad from the frozen groups; returns the names of the frozen parameters."""
    frozen = []
    for name, p in model.named_parameters():
        is_frozen = bool(groups_of(name, tied) & frozen_groups)
        p.requires_grad_(not is_frozen)
        if is_frozen:
            frozen.append(name)
    return frozen
