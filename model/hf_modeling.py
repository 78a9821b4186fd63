"""The transformers classes of the variants transformers does not know (MixiT, shaped attention, µP,
bidirectional): `TrainablePartsConfig` and `TrainablePartsForCausalLM`, a `GenerationMixin` over our
Transformer. This module and the project modules it imports are the modelling code an export ships
(model/hf_code.py), so it imports only torch, transformers and this repository's model code; model/hf.py
registers the classes with the Auto classes for processes that have this repository.

Generation: causal models decode with transformers' own cache (`DynamicCache`), filled by our layers through
`_CacheView`: keys and values for softmax and shaped attention, values only for MixiT. Two cases recompute
the whole sequence at every step instead (no cache): bidirectional models, whose earlier positions change
with every new token, and batches with padding (an attention_mask with zeros), where each row is run on its
own real tokens, so a padded row gives the tokens it gives alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from common.constants import IGNORE_INDEX
from common.errors import ConfigError

from .config import ModelConfig
from .hf_format import MODEL_TYPE
from .transformer import Transformer, new_tokens_that_fit

log = logging.getLogger(__name__)


class TrainablePartsConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, trainable_parts: dict[str, Any] | None = None, **kwargs: Any):
        self.trainable_parts = trainable_parts or {}
        cfg = ModelConfig.from_dict(self.trainable_parts)
        kwargs.setdefault("tie_word_embeddings", cfg.tie_embeddings)
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.hidden_size
        self.num_hidden_layers, self.max_position_embeddings = cfg.num_layers, cfg.max_seq_len


class _CacheView:
    """Our layers' cache interface (model.layers.KVCache) over a transformers `Cache`, so that `generate()`
    owns the cache (its length, beam reordering) and our layers fill it. MixiT keeps values only; its key
    slot holds one channel of the values, because a transformers cache measures its length by the keys."""

    def __init__(self, cache: Any):
        self.cache = cache

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def past_length(self, layer: int) -> int:
        return int(self.cache.get_seq_length(layer))

    def update(self, layer: int, k: torch.Tensor | None, v: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        keys, values = self.cache.update(v[..., :1] if k is None else k, v, layer)
        return (None if k is None else keys), values


# the output's cache field: `cache` in newer transformers, `past_key_values` before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _is_padded(attention_mask: torch.Tensor | None) -> bool:
    return attention_mask is not None and not bool(attention_mask.bool().all())


class TrainablePartsForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TrainablePartsConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def __init__(self, config: TrainablePartsConfig):
        super().__init__(config)
        self.model = Transformer(ModelConfig.from_dict(config.trainable_parts))
        if self.model.cfg.tie_embeddings:
            self._tied_weights_keys = {"model.lm_head.weight": "model.embed_tokens.weight"}
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass  # Transformer initialises itself; loading overwrites every tensor anyway

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None, *args: Any, **kwargs: Any):
        """transformers' generate(), stopped where the context is full (as eval.generate stops, with the same
        line): asked for more new tokens than fit after the prompt, it generates those that fit."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        config = generation_config if generation_config is not None else self.generation_config
        if ids is not None and ids.dim() == 2:
            n, T = ids.shape[1], self.model.cfg.max_seq_len
            max_new = kwargs.get("max_new_tokens", config.max_new_tokens)
            if max_new is None and kwargs.get("max_length") is not None:
                max_new = kwargs["max_length"] - n
            fit, cut = new_tokens_that_fit(T, n, max_new) if max_new is not None else (None, None)
            if cut and fit:  # a prompt that fills the context alone is the forward's error
                log.warning(cut)
                kwargs["max_new_tokens"] = fit
                kwargs.pop("max_length", None)
        return super().generate(inputs, generation_config, *args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
        """transformers' preparation, except where no cache can serve (a bidirectional model, a padded
        batch): then the whole sequence goes in at every step and the cache stays out."""
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        if not self.model.cfg.causal or _is_padded(kwargs.get("attention_mask")):
            inputs["input_ids"] = input_ids
            for name in ("cache", "past_key_values", "cache_position", "position_ids"):
                inputs.pop(name, None)
        return inputs

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        **_: Any,
    ) -> CausalLMOutputWithPast:
        """Logits of `input_ids` (after what `cache` holds). An attention_mask with zeros (padding) runs
        each row on its real tokens alone, without a cache; pad positions get zero logits."""
        cache = cache if cache is not None else past_key_values
        if use_cache is False or not self.model.cfg.causal:
            cache = None
        if _is_padded(attention_mask):
            if cache is not None and cache.get_seq_length() > 0:
                raise ConfigError(
                    "a padded batch (attention_mask with zeros) cannot continue from a cache. "
                    "Fix: pass the whole sequences with use_cache=False, or generate() (it recomputes padded batches)"
                )
            logits = self._padded_logits(input_ids, attention_mask)
            cache = None
        else:
            logits = self.model(input_ids, cache=None if cache is None else _CacheView(cache))
        loss = None
        if labels is not None:  # HF convention: labels are the inputs, shifted here
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    def _padded_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Each row's logits from its real tokens alone (MixiT's matrix and positions start at its first real
        token, as they would unpadded); a row of padding only gets zeros."""
        keep = attention_mask[:, -input_ids.shape[1] :].bool()
        out = None
        for row in range(input_ids.shape[0]):
            if not keep[row].any():
                continue
            logits = self.model(input_ids[row, keep[row]][None])[0]
            if out is None:
                out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
            out[row, keep[row]] = logits
        if out is None:
            raise ConfigError("every row of the batch is padding (attention_mask all zeros). Fix: pass real tokens")
        return out
