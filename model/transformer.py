"""The Llama-3 decoder with every variant, in plain PyTorch (no DeepSpeed here).

The model is split into three stages (embed -> blocks -> head) that the pipeline
wrapper in pretrain/ reuses as-is; `forward` is just their composition.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .freezing import apply_freeze
from .kernels.loss import linear_cross_entropy
from .layers import Block, KVCache, RMSNorm, rope_cos_sin

IGNORE_INDEX = -100


def doc_positions_and_mask(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From per-token document ids (b, t): positions restarting at each document, and a
    (b, t, t) mask that lets a token see only its own document (packed-sequence masking)."""
    b, t = doc_ids.shape
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    idx = torch.arange(t, device=doc_ids.device)
    starts = torch.where(torch.cat([torch.ones_like(doc_ids[:, :1], dtype=torch.bool),
                                    doc_ids[:, 1:] != doc_ids[:, :-1]], dim=1), idx, 0)
    positions = idx - torch.cummax(starts, dim=1).values
    return positions, same


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, d) \
            if cfg.mixer == "mixit" and cfg.mixit_pos_embedding else None
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Set by the trainer for activation checkpointing: fn(block, h, cos, sin) -> h.
        self.checkpoint_fn: Callable | None = None
        self.reset_parameters()
        self.set_step(0)
        if cfg.compile_blocks:
            for block in self.layers:
                block.compile()             # in place: parameter names and the state dict are unchanged

    # ---- initialisation and freezing ---------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, init_std) for matrices and embeddings, ones for norm gains, zeros for biases;
        Q/K that start frozen use qk_init_std (1/sqrt(d) by default, as in the paper)."""
        cfg = self.cfg
        qk_std = cfg.qk_init_std if "qk" in cfg.initial_frozen_groups() else cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "layernorm" in name or name.startswith("norm."):
                p.fill_(1.0)
            elif ".q_proj." in name or ".k_proj." in name:
                p.normal_(0.0, qk_std)
            else:
                p.normal_(0.0, cfg.init_std)

    def set_step(self, step: int) -> list[str]:
        """Apply the freeze schedule in effect at optimizer step `step`; returns frozen names."""
        return apply_freeze(self, self.cfg.frozen_groups_at(step), tied=self.cfg.tie_embeddings)

    # ---- the three stages --------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            h = h + self.embed_positions(positions)
        return h

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.cfg.mixer == "mixit":
            return None, None
        return rope_cos_sin(self.cfg, positions)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    # ---- forward -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                return_hidden: bool = False) -> torch.Tensor:
        """Logits (b, t, vocab), or the mean next-token loss when `labels` (already shifted,
        IGNORE_INDEX where unscored) is given. `doc_ids` enables per-document masking."""
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        if past + t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {past + t} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                             "use shorter sequences or a model built with a larger max_seq_len")
        attn_mask = None
        if doc_ids is not None:
            positions, attn_mask = doc_positions_and_mask(doc_ids)
        else:
            positions = torch.arange(past, past + t, device=input_ids.device)
        h = self.embed(input_ids, positions)
        cos, sin = self.rope(positions)
        for block in self.layers:
            if self.checkpoint_fn is not None and self.training and cache is None and attn_mask is None:
                h = self.checkpoint_fn(block, h, cos, sin)
            else:
                h = block(h, cos, sin, cache, attn_mask)
        if return_hidden:
            return h
        if labels is not None and self.cfg.loss_chunk_tokens:
            # never the full (b, t, vocab) logits: chunked, or Liger's fused kernel on CUDA (kernels/loss.py)
            return linear_cross_entropy(self.norm(h).flatten(0, 1), self.lm_head.weight, labels.flatten(),
                                        self.cfg.loss_chunk_tokens, IGNORE_INDEX)
        logits = self.head(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.num_layers)


def build_model(cfg: ModelConfig, seed: int | None = None, device: torch.device | str | None = None) -> Transformer:
    """Construct (and initialise) a model; `seed` makes the initial weights reproducible."""
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Transformer(cfg)
    else:
        model = Transformer(cfg)
    return model.to(device) if device is not None else model
