"""The native checkpoint format: `model.safetensors` + `config.json` in one directory.

Only safetensors and JSON are read, so loading a file can never run code. The MixiT
matrices are not stored: `config.json` holds the seed that regenerates them. Tied
embeddings are stored once (as embed_tokens.weight).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from common.constants import atomic_write
from common.errors import ConfigError

from .config import ModelConfig
from .transformer import Transformer

WEIGHTS_NAME, CONFIG_NAME = "model.safetensors", "config.json"
FORMAT = "trainable-parts-native-v1"


def save_native(model: Transformer, out_dir: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
    """Write weights (true dtypes, frozen tensors included; tied embeddings once) and config+meta atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(sd, str(tmp), metadata={"format": FORMAT})
    os.replace(tmp, out / WEIGHTS_NAME)
    doc = {"format": FORMAT, "model": model.cfg.to_dict(), "meta": dict(meta or {})}
    atomic_write(out / CONFIG_NAME, json.dumps(doc, indent=2, sort_keys=True))
    return out


def is_native(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not (p / CONFIG_NAME).is_file() or not (p / WEIGHTS_NAME).is_file():
        return False
    try:
        return json.loads((p / CONFIG_NAME).read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, OSError):
        return False


def read_native_config(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    doc = json.loads((Path(path) / CONFIG_NAME).read_text())
    return ModelConfig.from_dict(doc["model"]), doc.get("meta", {})


def load_native(path: str | os.PathLike, device: torch.device | str = "cpu") -> tuple[Transformer, dict[str, Any]]:
    """Rebuild the model from a native checkpoint."""
    path = Path(path)
    if not is_native(path):
        raise FileNotFoundError(
            f"{path} is not a native checkpoint (needs {WEIGHTS_NAME} and {CONFIG_NAME}). "
            "Fix: export one with `python -m pretrain.export --checkpoint RUN/checkpoints/TAG --out DIR`"
        )
    cfg, meta = read_native_config(path)
    model = Transformer(cfg)
    sd = load_file(str(path / WEIGHTS_NAME))
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    model.load_state_dict(sd, strict=True)
    model.set_step(int(meta.get("step", 0)))
    return model.to(device), meta


SHAPE_FIELDS = (
    "variant",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "max_seq_len",
    "tie_embeddings",
    "bias",
    "mixit_seed",
    "mixit_rng",
)


def check_compatible(want: ModelConfig, have: ModelConfig, where: str) -> None:
    """Refuse a checkpoint whose variant or shape differs from the configured model."""
    diffs = [
        f"{f}: config has {getattr(want, f)!r}, checkpoint has {getattr(have, f)!r}"
        for f in SHAPE_FIELDS
        if getattr(want, f) != getattr(have, f)
    ]
    if diffs:
        raise ConfigError(
            f"checkpoint {where} does not match the model config ({'; '.join(diffs)}). "
            "Fix: use the config the checkpoint was trained with, or point at another checkpoint."
        )
