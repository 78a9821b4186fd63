"""Resolve any checkpoint the trainer writes into (model, info), and tokenizers with identity checks.

Accepted paths (first match wins): whatever `pretrain.export.load_for_eval` understands
(native, HF, DeepSpeed tag, run dir); otherwise a native dir (model.io), an HF export
(model.hf, safetensors only, never remote code), or a run dir whose `checkpoints/`
holds native/HF subdirectories.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch


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
        from data_pipeline import load_tokenizer as _load
    except ImportError:
        from data_pipeline.tokenizer import load_tokenizer as _load
    try:
        return _load(spec)
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
_STEP_RE = re.compile(r"(\d+)")


def _is_hf_dir(p: Path) -> bool:
    if not (p / "config.json").is_file():
        return False
    try:
        return "model_type" in json.loads((p / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False


def _load_local(p: Path, device) -> tuple[torch.nn.Module, dict[str, Any]]:
    from model import io as mio
    if mio.is_native(p):
        return mio.load_native(p, device=device)
    if _is_hf_dir(p):
        from model import hf as mhf
        model = mhf.import_hf(p).to(device)
        meta = {}
        for name in ("trainer_meta.json", "meta.json"):
            if (p / name).is_file():
                meta = json.loads((p / name).read_text())
        return model, meta
    raise EvalError(f"no checkpoint found at {p}: expected a native checkpoint (model.safetensors + config.json), "
                    "an HF export (config.json + *.safetensors), a DeepSpeed checkpoint tag dir, or a run dir "
                    "with checkpoints/. Fix: point --checkpoint at one of these.")


def _step_from_name(p: Path) -> int | None:
    m = _STEP_RE.findall(p.name)
    return int(m[-1]) if m else None


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EvalError(f"run dir {run_dir} does not exist")
    try:
        from pretrain.checkpointing import list_checkpoints as _lc
        found = [(int(s), Path(p)) for s, p in _lc(run_dir)]
        if found:
            return found
    except (ImportError, AttributeError):
        pass
    # Fallback (and for runs whose checkpoints are native/HF exports): scan checkpoints/*.
    found = []
    ck = run_dir / "checkpoints"
    for p in sorted(ck.iterdir()) if ck.is_dir() else []:
        if not p.is_dir():
            continue
        from model import io as mio
        if mio.is_native(p):
            step = mio.read_native_config(p)[1].get("step")
        elif _is_hf_dir(p):
            step = None
        else:
            continue
        step = step if step is not None else _step_from_name(p)
        if step is not None:
            found.append((int(step), p))
    return sorted(found)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """(model in eval mode, info) where info has path, step, tokens_seen, variant, tokenizer_id (+ raw meta)."""
    p = Path(path)
    if not p.exists():
        raise EvalError(f"checkpoint path {p} does not exist. Fix: pass a native/HF/DeepSpeed checkpoint "
                        "directory or a run directory.")
    model = meta = None
    try:
        from pretrain.export import load_for_eval
    except ImportError:
        load_for_eval = None
    if load_for_eval is not None:
        try:
            model, meta = load_for_eval(str(p), device=str(device))
        except FileNotFoundError as e:
            raise EvalError(f"no checkpoint found at {p}: {e}") from e
    else:
        from model import io as mio
        if not mio.is_native(p) and not _is_hf_dir(p) and (p / "checkpoints").is_dir():
            ckpts = list_checkpoints(p)
            if not ckpts:
                raise EvalError(f"run dir {p} has no complete checkpoints under checkpoints/")
            p = ckpts[-1][1]
        model, meta = _load_local(p, device)
    model.eval()
    meta = dict(meta or {})
    cfg = model.cfg
    info = {"path": str(Path(path).resolve()), "step": meta.get("step"), "tokens_seen": meta.get("tokens_seen"),
            "variant": meta.get("variant", cfg.variant), "tokenizer_id": meta.get("tokenizer_id"),
            "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len, "meta": meta}
    return model, info
