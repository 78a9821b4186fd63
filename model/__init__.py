"""Llama-3 decoder and the trainable-parts variants (standard, frozen_qk, frozen_mlp, mixit, random_transformer).

The package exports the configuration only, so that loading a recipe builds nothing; the model itself is
`model.transformer` (`from model.transformer import Transformer, build_model`).
"""

from .config import PRESETS, VARIANTS, ModelConfig, param_count, preset

__all__ = ["ModelConfig", "PRESETS", "VARIANTS", "preset", "param_count"]
