"""Consolidate a training checkpoint into one model, and load any checkpoint for evaluation.

    python -m pretrain.export --checkpoint RUN/checkpoints/step_00000100 --out DIR [--format native|hf]

`--checkpoint` may be a DeepSpeed tag dir written by pretrain.train (ZeRO 0/1/2/3 or
pipeline), a run dir (its latest complete checkpoint), or a native dir. Every tensor comes
back: trainable ones from DeepSpeed's files (module states for ZeRO 0-2, the fp32 partitions
via zero_to_fp32 for ZeRO-3, per-layer files for pipeline stages), frozen ones verbatim
from the checkpoint's `frozen-stage*.safetensors` in their own dtype, tied embeddings once.
The MixiT matrices are regenerated from the seed in the model config.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from . import checkpointing as ckpt


def _torch_load(path: Path) -> Any:
    from .safety import safe_torch_load
    return safe_torch_load(path)          # weights_only=True; crafted pickles are refused


def _module_dtype(state: dict[str, Any]) -> torch.dtype:
    prec = state.get("recipe", {}).get("train", {}).get("precision", "fp32")
    return torch.bfloat16 if prec == "bf16" else torch.float32


def consolidated_state_dict(tag_dir: str | Path) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """(ModelConfig, full state dict in Transformer names, trainer state) of a tag dir."""
    from model import ModelConfig, Transformer
    tag_dir = Path(tag_dir)
    state = ckpt.read_state(tag_dir)
    from .safety import verify_checkpoint_dir
    verify_checkpoint_dir(tag_dir)         # zero_to_fp32 below unpickles in full: scan first
    mcfg = ModelConfig.from_dict(state["model_config"])
    dtype = _module_dtype(state)
    layer_files = sorted(tag_dir.glob("layer_*-model_states.pt"))
    sd: dict[str, torch.Tensor] = {}
    if layer_files:
        from .pipeline import layer_key_map
        with torch.device("meta"):
            ref = Transformer(mcfg)
        keymap = layer_key_map(ref)
        for f in layer_files:
            idx = int(f.name.split("_")[1].split("-")[0])
            for k, v in _torch_load(f).items():
                if k in keymap[idx]:
                    sd[keymap[idx][k]] = v
    else:
        files = sorted(tag_dir.glob("mp_rank_*_model_states.pt")) or sorted(tag_dir.glob("zero_pp_rank_*_model_states.pt"))
        if not files:
            raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states (*model_states.pt)")
        states = _torch_load(files[0])
        stage = int(states.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
        if stage >= 3:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            full = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
            sd = {k: v.to(dtype) for k, v in full.items()}
        else:
            sd = dict(states["module"])
    sd.update(ckpt.load_frozen(tag_dir))            # frozen tensors verbatim, own dtype
    if mcfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return mcfg, sd, state


def model_from_checkpoint(tag_dir: str | Path, device: str | torch.device = "cpu"):
    from model import Transformer
    from .classification import classifier_from_checkpoint, is_classification_state
    if is_classification_state(ckpt.read_state(Path(tag_dir))):
        return classifier_from_checkpoint(tag_dir, device)
    mcfg, sd, state = consolidated_state_dict(tag_dir)
    model = Transformer(mcfg)
    full = dict(sd)
    if mcfg.tie_embeddings:
        full["lm_head.weight"] = full["embed_tokens.weight"]
    missing = set(model.state_dict()) - set(full)
    if missing:
        raise RuntimeError(f"checkpoint {tag_dir} lacks tensors {sorted(missing)[:5]}...")
    # Keep each tensor's own dtype (frozen ones may differ from trainable ones).
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.data = full[name].clone()
    if mcfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.set_step(int(state.get("step", 0)))
    meta = {"step": state.get("step"), "tokens_seen": state.get("tokens_seen"),
            "tokenizer_id": state.get("tokenizer_id"), "variant": mcfg.variant, "source": str(tag_dir)}
    return model.to(device), meta


def _is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def load_for_eval(path: str | Path, device: str | torch.device = "cpu"):
    """(model, meta) from a native dir, an HF dir, a DeepSpeed tag dir or a run dir (latest).
    meta has step, tokens_seen, tokenizer_id, variant."""
    from model import io as mio
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if mio.is_native(p):
        model, meta = mio.load_native(p, device=device)
        meta = dict(meta)
        meta.setdefault("variant", model.cfg.variant)
        return model, meta
    if ckpt.is_complete(p):
        return model_from_checkpoint(p, device)
    if (p / ckpt.STATE).is_file():
        raise FileNotFoundError(f"{p} is an incomplete checkpoint (no {ckpt.COMPLETE} marker: the save was interrupted); "
                                "use an earlier checkpoint")
    if (p / "checkpoints").is_dir() or p.name == "checkpoints":
        run = p if (p / "checkpoints").is_dir() else p.parent
        latest = ckpt.latest_checkpoint(run)
        if latest is None:
            raise FileNotFoundError(f"run dir {run} has no complete checkpoint under checkpoints/")
        return model_from_checkpoint(latest, device)
    if _is_hf_dir(p):
        from model.hf import import_hf
        model = import_hf(p).to(device)
        meta = {}
        if (p / "trainer_meta.json").is_file():
            meta = json.loads((p / "trainer_meta.json").read_text())
        meta.setdefault("variant", model.cfg.variant)
        for k in ("step", "tokens_seen", "tokenizer_id"):
            meta.setdefault(k, None)
        return model, meta
    raise FileNotFoundError(f"no checkpoint at {p}: expected a native dir (model.safetensors + config.json), an HF "
                            f"dir (config.json + *.safetensors), a checkpoint tag dir ({ckpt.STATE} + {ckpt.COMPLETE}) "
                            "or a run dir with checkpoints/")


def export(checkpoint: str | Path, out: str | Path, fmt: str = "native") -> Path:
    model, meta = load_for_eval(checkpoint)
    out = Path(out)
    if fmt == "native":
        from model.io import save_native
        return save_native(model, out, meta)
    if fmt == "hf":
        from model.hf import export_hf
        export_hf(model, out)
        (out / "trainer_meta.json").write_text(json.dumps(meta, indent=1, default=str))
        return out
    raise ValueError(f"--format must be native or hf, got {fmt!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="tag dir, run dir, or native dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", choices=("native", "hf"), default="native")
    args = ap.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.format)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.format} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
