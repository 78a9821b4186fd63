"""One model from a trainer checkpoint, whatever layout wrote it.

Every tensor comes back: trainable ones from DeepSpeed's files (module states for ZeRO 0-2,
the fp32 partitions via zero_to_fp32 for ZeRO-3, per-layer files for pipeline stages),
frozen ones verbatim from the checkpoint's `frozen-stage*.safetensors` in their own dtype,
tied embeddings once. The MixiT matrices are regenerated from the seed in the model config.
Classification runs (recipe `task: classification`) come back as a SequenceClassifier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.deepspeed_import import import_deepspeed
from common.errors import CorruptCheckpoint
from data_pipeline.classification import resolve_pad_id
from data_pipeline.config import parse_data
from model import ModelConfig
from model.classifier import DEFAULT_POOLING, SequenceClassifier
from model.transformer import Transformer

from . import tag_format
from .pickle_scan import guarded_torch_load, safe_torch_load, verify_checkpoint_dir


def layer_key_map(model: Transformer) -> list[dict[str, str]]:
    """For each pipeline layer index: {layer state-dict key: Transformer state-dict key}.

    The order is the one pretrain/pipeline.py builds its PipelineModule in (token embedding,
    [position embedding], one layer per block, final norm, head); the pipeline export tests
    hold the two together."""
    cfg = model.cfg
    out = [{"embed_tokens.weight": "embed_tokens.weight"}]
    if model.embed_positions is not None:
        out.append({"embed_positions.weight": "embed_positions.weight"})
    for i, blk in enumerate(model.layers):
        out.append({f"block.{k}": f"layers.{i}.{k}" for k in blk.state_dict()})
    out.append({"norm.weight": "norm.weight"})
    out.append(
        {"embed_tokens.weight": "embed_tokens.weight"} if cfg.tie_embeddings else {"lm_head.weight": "lm_head.weight"}
    )
    return out


def consolidated_state_dict(tag_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(ModelConfig, full state dict in the trained module's names, trainer state) of a tag dir."""
    tag_dir = Path(tag_dir)
    state = tag_format.read_state(tag_dir)
    verify_checkpoint_dir(tag_dir)  # zero_to_fp32 below unpickles in full: scan first
    mcfg = ModelConfig.from_dict(state["model_config"])
    layer_files = sorted(tag_dir.glob("layer_*-model_states.pt"))
    sd: dict[str, torch.Tensor] = {}
    if layer_files:
        with torch.device("meta"):
            ref = Transformer(mcfg)
        keymap = layer_key_map(ref)
        for f in layer_files:
            idx = int(f.name.split("_")[1].split("-")[0])
            for k, v in safe_torch_load(f).items():
                if k in keymap[idx]:
                    sd[keymap[idx][k]] = v
    else:
        files = sorted(tag_dir.glob("mp_rank_*_model_states.pt")) or sorted(
            tag_dir.glob("zero_pp_rank_*_model_states.pt")
        )
        if not files:
            raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states (*model_states.pt)")
        states = safe_torch_load(files[0])
        stage = int(states.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
        if stage >= 3:
            import_deepspeed()
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # deferred: heavy

            with guarded_torch_load():  # zero_to_fp32 reads only what was scanned, weights-only
                full = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
            bf16 = state.get("recipe", {}).get("train", {}).get("precision") == "bf16"
            sd = {k: v.to(torch.bfloat16 if bf16 else torch.float32) for k, v in full.items()}
        else:
            sd = dict(states["module"])
    sd.update(tag_format.load_frozen(tag_dir))  # frozen tensors verbatim, own dtype
    if mcfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return mcfg, sd, state


def _fill(model: torch.nn.Module, lm: Transformer, sd: dict[str, torch.Tensor], state: dict, tag_dir: Path) -> None:
    """Copy `sd` into `model` (whose language model is `lm`), keeping each tensor's own dtype (frozen ones
    may differ from trainable ones); tie the embeddings where the config does, and set the step."""
    full = dict(sd)
    prefix = "" if lm is model else "model."
    if lm.cfg.tie_embeddings:
        full[f"{prefix}lm_head.weight"] = full[f"{prefix}embed_tokens.weight"]
    missing = set(model.state_dict()) - set(full)
    if missing:
        raise CorruptCheckpoint(
            f"checkpoint {tag_dir} lacks tensors {sorted(missing)[:5]} that its model config has. Fix: check that "
            "the checkpoint was written completely (or by this version), or use an earlier complete checkpoint"
        )
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.data = full[name].clone()
    if lm.cfg.tie_embeddings:
        lm.lm_head.weight = lm.embed_tokens.weight
    model.set_step(int(state.get("step", 0)))


def _meta(state: dict[str, Any], mcfg: ModelConfig, tag_dir: Path) -> dict[str, Any]:
    """What evaluation needs besides weights; `data` (the recipe's section) locates the run's tokenizer."""
    return {
        "step": state.get("step"),
        "tokens_seen": state.get("tokens_seen"),
        "tokenizer_id": state.get("tokenizer_id"),
        "variant": mcfg.variant,
        "source": str(tag_dir),
        "data": (state.get("recipe") or {}).get("data"),
    }


def classifier_from_checkpoint(tag_dir: str | Path, device: str | torch.device = "cpu"):
    """(SequenceClassifier, meta) from a trainer checkpoint of a classification run."""
    tag_dir = Path(tag_dir)
    mcfg, sd, state = consolidated_state_dict(tag_dir)
    recipe = state.get("recipe", {})
    pooling = (recipe.get("classification") or {}).get("pooling", DEFAULT_POOLING)
    data = recipe.get("data") or {}
    pad_id = resolve_pad_id(parse_data(data))
    model = SequenceClassifier(Transformer(mcfg), int(sd["score.weight"].shape[0]), pooling, pad_id)
    _fill(model, model.model, sd, state, tag_dir)
    meta = {
        **_meta(state, mcfg, tag_dir),
        "task": "classification",
        "data": data,
        "seq_len": recipe.get("train", {}).get("seq_len"),
    }
    return model.to(device), meta


def model_from_checkpoint(tag_dir: str | Path, device: str | torch.device = "cpu"):
    """(model, meta) of a complete tag dir: a Transformer, or a SequenceClassifier for classification runs."""
    tag_dir = Path(tag_dir)
    if tag_format.read_state(tag_dir).get("recipe", {}).get("task") == "classification":
        return classifier_from_checkpoint(tag_dir, device)
    mcfg, sd, state = consolidated_state_dict(tag_dir)
    model = Transformer(mcfg)
    _fill(model, model, sd, state, tag_dir)
    return model.to(device), _meta(state, mcfg, tag_dir)
