"""Checkpoints and tokenizers for evaluation: (model, info) from any checkpoint the checkpoint
layer reads (native, HF, DeepSpeed tag, run dir), and tokenizers with identity checks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpoint import load_for_eval, run_checkpoints
from data_pipeline.tokenizer import load_tokenizer as load_data_tokenizer


class EvalError(ValueError):
    """A user-facing error: bad checkpoint path, tokenizer mismatch, unknown task, ..."""


# ---- tokenizers --------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 and EOS = 256: a tokenizer-free fallback for text probes."""

    kind = "bytes"
    identity = "bytes:utf8-v1"
    vocab_size = 257
    eos_id = 256
    bos_id = -1
    pad_id = 256
    path = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def load_tokenizer(spec: Any):
    """`"bytes"` -> ByteTokenizer; a directory -> data_pipeline's tokenizer; a tokenizer object is returned as is."""
    if spec is None or not isinstance(spec, (str, Path)):
        return spec
    if str(spec) == "bytes":
        return ByteTokenizer()
    if not Path(spec).exists():
        raise EvalError(f"tokenizer {spec} does not exist; pass --tokenizer DIR (the directory the data was "
                        "prepared with) or --tokenizer bytes for the byte-level fallback")
    try:
        return load_data_tokenizer(spec)
    except ValueError as e:   # DataError
        raise EvalError(str(e)) from e


def check_tokenizer(tok, model, info: dict[str, Any]) -> None:
    """Refuse a tokenizer whose identity or vocabulary does not fit the checkpoint."""
    if tok is None:
        return
    want = info.get("tokenizer_id")
    if want and getattr(tok, "identity", None) and want != tok.identity:
        raise EvalError(f"tokenizer mismatch: checkpoint {info.get('path')} was trained with tokenizer {want}, "
                        f"but the given tokenizer is {tok.identity} ({getattr(tok, 'path', tok)}). "
                        "Fix: pass --tokenizer pointing at the tokenizer the run was trained with.")
    if tok.vocab_size > model.cfg.vocab_size:
        raise EvalError(f"tokenizer mismatch: tokenizer {tok.identity} has {tok.vocab_size} tokens but the "
                        f"checkpoint's vocabulary has {model.cfg.vocab_size}. Fix: use the run's tokenizer.")


# ---- checkpoints -------------------------------------------------------------------------
def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every checkpoint of a run as (step, path), oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EvalError(f"run dir {run_dir} does not exist")
    return run_checkpoints(run_dir)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """(model in eval mode, info) where info has path, step, tokens_seen, variant, tokenizer_id (+ raw meta)."""
    p = Path(path)
    if not p.exists():
        raise EvalError(f"checkpoint path {p} does not exist. Fix: pass a native/HF/DeepSpeed checkpoint "
                        "directory or a run directory.")
    try:
        model, meta = load_for_eval(p, device=str(device))
    except FileNotFoundError as e:
        raise EvalError(f"no checkpoint found at {p}: {e}") from e
    model.eval()
    meta = dict(meta or {})
    cfg = model.cfg
    info = {"path": str(p.resolve()), "step": meta.get("step"), "tokens_seen": meta.get("tokens_seen"),
            "variant": meta.get("variant", cfg.variant), "tokenizer_id": meta.get("tokenizer_id"),
            "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len, "meta": meta}
    return model, info
