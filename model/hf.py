"""HuggingFace interop through transformers: export to `from_pretrained`-loadable checkpoints (safetensors),
and the registration of the class that generates with them (reading a directory back needs no transformers:
model/hf_format.py).

Softmax variants (standard, frozen_qk, frozen_mlp, random_transformer) are Llama-3 networks and export
to a plain `LlamaForCausalLM` directory (parameter names already match: export adds the `model.`
prefix); the config's `trainable_parts` entry keeps our ModelConfig, so an import restores it exactly.
MixiT, shaped attention, µP and bidirectional models are not Llamas: they export to
`TrainablePartsForCausalLM` (model/hf_modeling.py) with its modelling code beside the weights and an
`auto_map` in config.json (model/hf_code.py), so any process with torch and transformers loads them when the
user opts in to remote code (trust_remote_code); in a process with this repository, `import model.hf` registers the class with the
Auto classes instead, and they load with no remote code (this project's own loaders never pass it).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from common.deepspeed_import import import_deepspeed

from .config import ModelConfig
from .hf_code import auto_map, write_modelling_code
from .hf_format import MODEL_TYPE, is_llama, llama_config_fields
from .hf_modeling import TrainablePartsConfig, TrainablePartsForCausalLM
from .transformer import Transformer


def llama_config(cfg: ModelConfig) -> LlamaConfig:
    """transformers' LlamaConfig of a network that is a Llama (model/hf_format.py refuses one that is not)."""
    return LlamaConfig(**llama_config_fields(cfg))


AutoConfig.register(MODEL_TYPE, TrainablePartsConfig, exist_ok=True)
AutoModelForCausalLM.register(TrainablePartsConfig, TrainablePartsForCausalLM, exist_ok=True)


# ---- export / import --------------------------------------------------------------------
def to_hf(model: Transformer) -> PreTrainedModel:
    """An in-memory HF model with our weights (same dtype, on CPU): a LlamaForCausalLM where the network
    is one (our names with a `model.` prefix), else the registered TrainablePartsForCausalLM."""
    dtype = next(model.parameters()).dtype
    if not is_llama(model.cfg):
        hf = TrainablePartsForCausalLM(TrainablePartsConfig(trainable_parts=model.cfg.to_dict()))
        hf.model.load_state_dict(model.state_dict())
        return hf.to(dtype).eval()
    hf = LlamaForCausalLM(llama_config(model.cfg)).to(dtype)
    sd = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if not (model.cfg.tie_embeddings and m == "lm_head.weight")]:
        raise RuntimeError(f"HF export mismatch: missing={missing} unexpected={unexpected}")
    return hf.eval()


def export_hf(model: Transformer, out_dir: str | os.PathLike, eos_id: int | None = None) -> Path:
    """Write a `from_pretrained`-loadable directory (safetensors, true dtype; for a network that is not a
    Llama, also its modelling code, named by config.json's `auto_map`). `eos_id` (the tokenizer's end of
    document) goes into the config and generation_config, so `generate()` stops where eval.generate stops."""
    out = Path(out_dir)
    # save_pretrained imports DeepSpeed where it is installed: this import leaves out mlflow (1.3 s)
    if importlib.util.find_spec("deepspeed"):
        import_deepspeed()
    hf = to_hf(model)
    if eos_id is not None:
        hf.config.eos_token_id = hf.generation_config.eos_token_id = eos_id
        hf.generation_config.pad_token_id = eos_id  # no pad token: generate() pads a finished row with EOS
    if isinstance(hf, TrainablePartsForCausalLM):
        hf.config.auto_map = auto_map()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for writing one small file set is noise (and a log's garbage)
    try:
        hf.save_pretrained(out, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if isinstance(hf, TrainablePartsForCausalLM):
        write_modelling_code(out)
    return out
