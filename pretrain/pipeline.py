"""The Transformer as a DeepSpeed PipelineModule (Megatron-style stages).

Layers, in order: token embedding, [MixiT position embedding], one layer per block,
final norm, head. With tied embeddings the embedding and the head are the same
`TiedLayerSpec("embed", ...)`: DeepSpeed keeps one copy per stage that holds it and
all-reduces its gradient between the first and last stage.

Every layer wraps the submodules of an already-built `model.Transformer` (built from the
same seed on every rank), so the pipeline computes exactly the function of the plain
model and starts from the same weights. checkpoint/consolidate.py's `layer_key_map` maps each
layer's state-dict keys back to Transformer names (keep the two in the same order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import IGNORE_INDEX, Transformer
from model.layers import rope_cos_sin


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
        if self.cfg.mixer == "mixit":
            cos = sin = None
        else:
            cos, sin = rope_cos_sin(self.cfg, torch.arange(h.shape[1], device=h.device))
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

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


def tied_head(module: TokenEmbed, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, module.embed_tokens.weight)


def pipe_loss(logits: torch.Tensor, labels) -> torch.Tensor:
    """Summed token cross-entropy times a per-step scale (see train.loss_scale)."""
    labels, scale = labels
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return ce * scale.to(ce.dtype).reshape(())


def build_pipeline(model: Transformer, num_stages: int, partition_method: str, activation_checkpointing: bool,
                   seed: int):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # deferred: heavy (deepspeed)

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
        specs.append(TiedLayerSpec("embed", TokenEmbed, model, forward_fn=tied_head,
                                   tied_weight_attr="embed_tokens.weight"))
    else:
        specs.append(LayerSpec(HeadPipe, model))
    return PipelineModule(layers=specs, num_stages=num_stages, loss_fn=pipe_loss,
                          partition_method=partition_method, base_seed=seed,
                          activation_checkpoint_interval=1 if activation_checkpointing else 0,
                          checkpointable_layers=["BlockPipe"])
