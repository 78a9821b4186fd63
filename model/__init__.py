"""Llama-3 decoder and the trainable-parts variants (standard, frozen_qk, frozen_mlp, mixit, random_transformer)."""

from .config import PRESETS, VARIANTS, ModelConfig, param_count, preset
from .transformer import Transformer, build_model

__all__ = ["ModelConfig", "PRESETS", "VARIANTS", "preset", "param_count", "Transformer", "build_model"]
