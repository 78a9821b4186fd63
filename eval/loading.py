"""Checkpoints and tokenizers for evaluation: (model, info) from any checkpoint the checkpoint
layer reads (native, HF, DeepSpeed tag, run dir), and tokenizers with identity checks; without a
tokenizer given, the one the checkpoint records (`pick_tokenizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpoint import load_for_eval
from common.constants import REPO_ROOT, repo_path
from common.errors import EvalError
from data_pipeline.shards import MANIFEST, read_manifest
from data_pipeline.tokenizer import BYTE_TOKENIZER, BYTES
from data_pipeline.tokenizer import load_tokenizer as load_data_tokenizer


# ---- tokenizers --------------------------------------------------------------------------
def load_tokenizer(spec: Any):
    """`"bytes"` -> the byte tokenizer; a directory -> data_pipeline's tokenizer; a tokenizer object is returned as is."""
    if spec is None or not isinstance(spec, (str, Path)):
        return spec
    if str(spec) != BYTES and not Path(spec).exists():
        raise EvalError(
            f"tokenizer {spec} does not exist. Fix: pass --tokenizer DIR (the directory the data was "
            "prepared with), --tokenizer bytes for the byte tokenizer, or omit --tokenizer to use the "
            "one the checkpoint was trained with"
        )
    try:
        return load_data_tokenizer(spec)
    except ValueError as e:  # DataError
        raise EvalError(str(e)) from e


def _candidate_tokenizers(meta: dict[str, Any]) -> list[str]:
    """Tokenizer locations a checkpoint's recorded recipe points at: data.tokenizer, then the
    tokenizer_path of each shard directory's manifest (the recipe's source or mixture paths)."""
    data = meta.get("data") or {}
    out = [str(x) for x in (data.get("tokenizer"), meta.get("tokenizer_path")) if x]
    dirs = [data.get("source")] + [m.get("path") for m in data.get("mixture") or [] if isinstance(m, dict)]
    for d in dirs:
        if not isinstance(d, str) or ":" in d.split("/")[0]:  # text:, synthetic:, classify:, hf:, s3: ...
            continue
        for base in (Path(d), REPO_ROOT / d):
            if (base / MANIFEST).is_file():
                try:
                    path = read_manifest(base).get("tokenizer_path")
                except ValueError:
                    break
                if path:
                    out.append(str(path))
                break
    return out


def run_tokenizer(info: dict[str, Any]):
    """The tokenizer a checkpoint was trained with, from what it records (for `--tokenizer` omitted):
    the byte tokenizer for identity `bytes`, else the recorded recipe's data.tokenizer or its shards'
    tokenizer_path, whichever still exists with the recorded identity. None when nothing is found."""
    want = info.get("tokenizer_id")
    if not want:
        return None
    if want == BYTES:
        return BYTE_TOKENIZER
    for spec in _candidate_tokenizers(info.get("meta") or {}):
        try:
            tok = load_data_tokenizer(spec if spec == BYTES else repo_path(spec))
        except ValueError:
            continue
        if tok.identity == want:
            return tok
    return None


def missing_tokenizer_error(info: dict[str, Any], needs: str) -> EvalError:
    want = info.get("tokenizer_id")
    where = (
        f"the checkpoint records tokenizer {want}, which was not found from its recipe (data.tokenizer or "
        "the shards' manifest)"
        if want
        else "the checkpoint records no tokenizer"
    )
    return EvalError(
        f"{needs} needs a tokenizer and {where}. Fix: pass --tokenizer DIR (the tokenizer the run was "
        "trained with) or --tokenizer bytes"
    )


def pick_tokenizer(spec: Any, model, info: dict[str, Any]):
    """The tokenizer `spec` names (`load_tokenizer`), or with none given the checkpoint's own (`run_tokenizer`,
    None when not found); refused if its identity or vocabulary does not fit the checkpoint."""
    tok = load_tokenizer(spec) if spec is not None else run_tokenizer(info)
    want = info.get("tokenizer_id")
    if tok is not None and want and getattr(tok, "identity", None) and want != tok.identity:
        raise EvalError(
            f"tokenizer mismatch: checkpoint {info.get('path')} was trained with tokenizer {want}, "
            f"but the given tokenizer is {tok.identity} ({getattr(tok, 'path', tok)}). "
            "Fix: omit --tokenizer to use the run's own, or pass the tokenizer the run was trained with."
        )
    if tok is not None and tok.vocab_size > model.cfg.vocab_size:
        raise EvalError(
            f"tokenizer mismatch: tokenizer {tok.identity} has {tok.vocab_size} tokens but the "
            f"checkpoint's vocabulary has {model.cfg.vocab_size}. Fix: use the run's tokenizer."
        )
    return tok


# ---- checkpoints -------------------------------------------------------------------------
def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """(model in eval mode, info) where info has path, step, tokens_seen, variant, tokenizer_id (+ raw meta)."""
    p = Path(path)
    if not p.exists():
        raise EvalError(
            f"checkpoint path {p} does not exist. Fix: pass a native/HF/DeepSpeed checkpoint "
            "directory or a run directory."
        )
    try:
        model, meta = load_for_eval(p, device=str(device))
    except FileNotFoundError as e:
        raise EvalError(
            f"no checkpoint found at {p}: {e}. Fix: pass a native/HF/DeepSpeed checkpoint directory or a run directory"
        ) from e
    model.eval()
    meta = dict(meta or {})
    cfg = model.cfg
    return model, {
        "path": str(p.resolve()),
        "step": meta.get("step"),
        "tokens_seen": meta.get("tokens_seen"),
        "variant": meta.get("variant", cfg.variant),
        "tokenizer_id": meta.get("tokenizer_id"),
        "vocab_size": cfg.vocab_size,
        "max_seq_len": cfg.max_seq_len,
        "meta": meta,
    }
