"""The Transformer as a DeepSpeed PipelineModule (Megatron-style stages).

Layers, in order: token embedding, [MixiT position embedding], one layer per block, final norm,
head; with tied embeddings the embedding and the head are one `TiedLayerSpec("embed", ...)`. Every
layer wraps submodules of one `model.Transformer` built on the meta device, and only this stage's
tensors are allocated (pretrain/parallelize.py). checkpoint/consolidate.py's `layer_key_map` maps
each layer's state-dict keys back to Transformer names (keep the two in the same order).

The last layer hands the loss the final hidden states and the head matrix, never logits: DeepSpeed
gives the labels to `loss_fn` only, so the chunked loss (model/kernels/loss.py) runs there.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from common.constants import IGNORE_INDEX
from model.kernels.loss import linear_cross_entropy
from model.layers import rope_cos_sin
from model.transformer import Transformer


class TokenEmbed(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.embed_tokens = model.embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class PosEmbed(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.embed_positions = model.embed_positions

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device)
        return h + self.embed_positions(pos)


class BlockPipe(nn.Module):
    def __init__(self, model: Transformer, i: int):
        super().__init__()
        self.cfg = model.cfg
        self.block = model.layers[i]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device)
        cos, sin = (None, None) if self.cfg.mixer == "mixit" else rope_cos_sin(self.cfg, positions, h.dtype)
        return self.block(h, cos, sin)


class NormPipe(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.norm = model.norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class HeadPipe(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.lm_head = model.lm_head

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.lm_head.weight


def tied_head(module: TokenEmbed, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return h, module.embed_tokens.weight


def pipe_loss(outputs: tuple[torch.Tensor, torch.Tensor], labels, chunk: int) -> torch.Tensor:
    """Summed token cross-entropy of (hidden states, head matrix) times a per-step scale (see
    engine.py): chunked, never the full (tokens, vocab) logits, unless `chunk` is 0."""
    h, weight = outputs
    labels, scale = labels
    ce = linear_cross_entropy(h.flatten(0, 1), weight, labels.flatten(), chunk, IGNORE_INDEX, reduction="sum")
    return ce * scale.to(ce.dtype).reshape(())


def build_pipeline(
    model: Transformer, num_stages: int, partition_method: str, seed: int, materialise: Callable[[nn.Module], None]
):
    """This rank's stage of `model` as a PipelineModule; `materialise(stage)` allocates the tensors
    of the layers DeepSpeed built for it (before it moves them to the device)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # deferred: heavy (deepspeed)

    class StagePipeline(PipelineModule):
        def _build(self):
            super()._build()  # this stage's layers only (DeepSpeed may build others to count them)
            materialise(self)

    specs = []
    if model.cfg.tie_embeddings:
        specs.append(TiedLayerSpec("embed", TokenEmbed, model, tied_weight_attr="embed_tokens.weight"))
    else:
        specs.append(LayerSpec(TokenEmbed, model))
    if model.embed_positions is not None:
        specs.append(LayerSpec(PosEmbed, model))
    specs += [LayerSpec(BlockPipe, model, i) for i in range(len(model.layers))]
    specs.append(LayerSpec(NormPipe, model))
    if model.cfg.tie_embeddings:
        specs.append(
            TiedLayerSpec("embed", TokenEmbed, model, forward_fn=tied_head, tied_weight_attr="embed_tokens.weight")
        )
    else:
        specs.append(LayerSpec(HeadPipe, model))
    return StagePipeline(
        layers=specs,
        num_stages=num_stages,
        loss_fn=functools.partial(pipe_loss, chunk=model.cfg.loss_chunk_tokens),
        partition_method=partition_method,
        base_seed=seed,
    )
