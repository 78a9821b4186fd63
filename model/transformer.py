"""The Llama-3 decoder with every variant, in plain PyTorch (no DeepSpeed here; the pipeline
stages of pretrain/pipeline.py wrap its submodules)."""

from __future__ import annotations

import math

import torch
from torch import nn

from common.errors import ConfigError

from .config import ModelConfig
from .freezing import apply_freeze
from .init import draw_seed, is_hidden_matrix, normal
from .layers import Block, KVCache, LMHead, RMSNorm, rope_cos_sin, width_factor


def doc_positions_and_mask(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From per-token document ids (b, t): positions restarting at each document, and a
    (b, t, t) mask that lets a token see only its own document (packed-sequence masking)."""
    b, t = doc_ids.shape
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    idx = torch.arange(t, device=doc_ids.device)
    starts = torch.where(
        torch.cat([torch.ones_like(doc_ids[:, :1], dtype=torch.bool), doc_ids[:, 1:] != doc_ids[:, :-1]], dim=1), idx, 0
    )
    positions = idx - torch.cummax(starts, dim=1).values
    return positions, same


class Transformer(nn.Module):
    """`init_seed` fixes the initial weights (model/init.py: each tensor from its own name); None
    draws it from torch's global generator. Built on the meta device, nothing is allocated and
    `initial_value` later gives any tensor's value on its own."""

    def __init__(self, cfg: ModelConfig, init_seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.init_seed = draw_seed() if init_seed is None else int(init_seed)
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.embed_positions = (
            nn.Embedding(cfg.max_seq_len, d) if cfg.mixer == "mixit" and cfg.mixit_pos_embedding else None
        )
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        # the logits' multipliers: MixiT's head width factor, µP's 1/m
        self.norm = RMSNorm(d, cfg.rms_norm_eps, width_factor(cfg, d, cfg.mixit_head_width_base) / cfg.width_mult)
        self.lm_head = LMHead(d, cfg.vocab_size, cfg.loss_chunk_tokens)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()
        self.set_step(0)
        if cfg.compile_blocks:
            for block in self.layers:
                block.compile()  # in place: parameter names and the state dict are unchanged

    # ---- initialisation and freezing ---------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every allocated parameter (not on the meta device) takes its `initial_value`."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                p.copy_(self.initial_value(name, p.shape))

    def initial_value(self, name: str, shape) -> torch.Tensor:
        """The initial value of parameter `name` (fp32, CPU): N(0, init_std) for matrices and
        embeddings, ones for norm gains, zeros for biases; Q/K use qk_init_std in every variant (1/sqrt(d)
        by default, as the paper's frozen Q/K). Random ones depend on (init_seed, name) only."""
        cfg = self.cfg
        if name.endswith("bias"):
            return torch.zeros(tuple(shape), device="cpu")
        if "layernorm" in name or name.startswith("norm."):
            return torch.ones(tuple(shape), device="cpu")
        if ".q_proj." in name or ".k_proj." in name:
            std = cfg.qk_init_std  # its default 1/sqrt(d) is fan-in scaled already, as µP's hidden init
        elif is_hidden_matrix(name):
            std = cfg.init_std / math.sqrt(cfg.width_mult)  # µP: 1/sqrt(m) (m = 1 under the standard one)
        else:
            std = cfg.init_std
        return normal(shape, std, self.init_seed, name)

    def set_step(self, step: int) -> list[str]:
        """Apply the freeze schedule in effect at optimizer step `step`; returns frozen names."""
        return apply_freeze(self, self.cfg.frozen_groups_at(step), tied=self.cfg.tie_embeddings)

    # ---- forward -----------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        return_hidden: bool = False,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Logits (b, t, vocab), or the next-token loss when `labels` (already shifted,
        IGNORE_INDEX where unscored) is given: the mean over scored tokens, or their sum with
        reduction="sum" (0 when none is scored). `doc_ids` enables per-document masking."""
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        if past + t > self.cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {past + t} exceeds model.max_seq_len={self.cfg.max_seq_len}. "
                "Fix: use shorter sequences or a model built with a larger max_seq_len"
            )
        attn_mask = None
        if doc_ids is not None:
            positions, attn_mask = doc_positions_and_mask(doc_ids)
        else:
            positions = torch.arange(past, past + t, device=input_ids.device)
        h = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            h = h + self.embed_positions(positions)
        cos, sin = (None, None) if self.cfg.mixer == "mixit" else rope_cos_sin(self.cfg, positions, h.dtype)
        for block in self.layers:
            h = block(h, cos, sin, cache, attn_mask)
        if return_hidden:
            return h
        # the logits, or with labels the loss of the head's own forward (chunked unless loss_chunk_tokens=0)
        return self.lm_head(self.norm(h), labels, reduction)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.num_layers)


def new_tokens_that_fit(max_seq_len: int, prompt_len: int, wanted: int) -> tuple[int, str | None]:
    """How many of `wanted` new tokens a model of `max_seq_len` positions generates after a prompt of
    `prompt_len` tokens (the last one predicted from a full context: the sequence ends at max_seq_len + 1
    tokens), and, when that is fewer than wanted, the one line every generate path says as it stops there."""
    fit = max(0, max_seq_len + 1 - prompt_len)
    if wanted <= fit:
        return wanted, None
    return fit, (
        f"generate: {wanted} new tokens asked, {fit} fit after a prompt of {prompt_len} tokens in the model's "
        f"max_seq_len={max_seq_len}; generation stops there"
    )


def build_model(cfg: ModelConfig, seed: int | None = None, device: torch.device | str | None = None) -> Transformer:
    """Construct (and initialise) a model; `seed` (the init seed) makes the initial weights reproducible."""
    model = Transformer(cfg, init_seed=seed)
    return model.to(device) if device is not None else model
