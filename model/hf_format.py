"""The HuggingFace Llama format without transformers: which of our networks are Llamas, the config fields
of one, and reading a local HF directory (config.json + safetensors) into our model. Loading a checkpoint
(checkpoint/load.py) reads HF directories through this module, so a training start never imports
transformers; model/hf.py builds transformers' classes from these fields."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from common.errors import ConfigError

from .config import ModelConfig
from .transformer import Transformer

MODEL_TYPE = "trainable_parts"


# ---- Llama (softmax variants) -----------------------------------------------------------
def is_llama(cfg: ModelConfig) -> bool:
    """True when the network is exactly a Llama (causal softmax attention, unshaped, the standard
    parametrisation: µP's logit and attention multipliers are not a Llama's)."""
    return cfg.mixer == "softmax" and cfg.causal and not cfg.shaped and cfg.parametrization == "standard"


def llama_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' LlamaConfig arguments for a network that is exactly a Llama."""
    if not is_llama(cfg):
        raise ConfigError(
            f"variant {cfg.variant!r} (causal={cfg.causal}) is not a Llama. Fix: use export_hf, "
            "which writes it to the registered TrainablePartsForCausalLM class"
        )
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        # HF's rope_parameters: the default RoPE, or llama3 scaling with the same four numbers
        rope_parameters={"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
        hidden_act="silu",
        initializer_range=cfg.init_std,
        bos_token_id=None,
        eos_token_id=None,
        trainable_parts=cfg.to_dict(),
    )


def _read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in path.glob("*.safetensors")]
    if not files:
        raise FileNotFoundError(
            f"{path} has no *.safetensors weights. Fix: convert the checkpoint to safetensors "
            "(pickle .bin files are not loaded, since they can run code)"
        )
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        sd.update(load_file(str(path / name)))
    return sd


def config_from_llama(hf_cfg: dict[str, Any], **overrides: Any) -> ModelConfig:
    if "trainable_parts" in hf_cfg:
        return ModelConfig.from_dict({**hf_cfg["trainable_parts"], **overrides})
    rope = hf_cfg.get("rope_parameters") or {}
    heads = hf_cfg["num_attention_heads"]
    if hf_cfg.get("head_dim") not in (None, hf_cfg["hidden_size"] // heads):
        raise ConfigError("head_dim != hidden_size / num_attention_heads is not supported")
    return ModelConfig(
        vocab_size=hf_cfg["vocab_size"],
        hidden_size=hf_cfg["hidden_size"],
        intermediate_size=hf_cfg["intermediate_size"],
        num_layers=hf_cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf_cfg.get("num_key_value_heads") or heads,
        max_seq_len=hf_cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=hf_cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", hf_cfg.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_from_hf(hf_cfg),
        tie_embeddings=hf_cfg.get("tie_word_embeddings", False),
        bias=bool(hf_cfg.get("attention_bias", False)),
        **overrides,
    )


def rope_scaling_from_hf(hf_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Our model.rope_scaling from an HF config: `rope_parameters` (transformers >= 5) or the older
    `rope_scaling` (whose type key was once `type`). An unsupported type is left for ModelConfig to refuse."""
    rope = dict(hf_cfg.get("rope_parameters") or hf_cfg.get("rope_scaling") or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            "rope_parameters.partial_rotary_factor != 1 is not supported. "
            "Fix: import a Llama whose rotary embedding covers the whole head"
        )
    if kind in ("default", None):
        return None
    rope.pop("rope_theta", None)
    if kind == "llama3":  # as transformers: a top-level value first, else the model's own context
        rope["original_max_position_embeddings"] = hf_cfg.get(
            "original_max_position_embeddings",
            rope.get("original_max_position_embeddings", hf_cfg.get("max_position_embeddings", 2048)),
        )
    return {"rope_type": kind, **rope}


def import_hf(path: str | os.PathLike, **overrides: Any) -> Transformer:
    """Load a local HF Llama (or an exported TrainablePartsForCausalLM) directory into our model.

    `overrides` set ModelConfig fields, e.g. variant="frozen_qk" to freeze parts of a
    pretrained Llama. Only safetensors weights are read; nothing executes remote code.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a HuggingFace model directory")
    hf_cfg = json.loads(cfg_file.read_text())
    model_type = hf_cfg.get("model_type")
    if model_type not in ("llama", MODEL_TYPE):
        raise ConfigError(f"{path}: model_type {model_type!r} is not supported (expected 'llama' or '{MODEL_TYPE}')")
    if model_type == "llama" and hf_cfg.get("mlp_bias", False) != hf_cfg.get("attention_bias", False):
        raise ConfigError("attention_bias and mlp_bias must agree (our `bias` switch covers both)")
    cfg = config_from_llama(hf_cfg, **overrides)
    sd = _read_hf_weights(path)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    if cfg.tie_embeddings:
        sd.setdefault("lm_head.weight", sd["embed_tokens.weight"])
    model = Transformer(cfg)
    dtype = next(iter(sd.values())).dtype
    model.to(dtype).load_state_dict(sd, strict=True)
    return model
