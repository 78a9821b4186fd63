"""Consolidate any checkpoint into one model directory (native or HuggingFace).

    python -m pretrain.export --checkpoint RUN/checkpoints/step_00000100 --out DIR [--format native|hf] [--tokenizer TOK]

`--checkpoint` may be a DeepSpeed tag dir written by pretrain.train (ZeRO 0/1/2/3 or
pipeline), a run dir (its latest complete checkpoint), or a native dir; reading them is the
checkpoint layer's job (checkpoint/load.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from checkpoint import load_for_eval
from common.cli import CliParser, run_cli
from common.errors import RecipeError
from eval.loading import load_checkpoint, pick_tokenizer
from model.hf import export_hf
from model.io import save_native


def export(checkpoint: str | Path, out: str | Path, fmt: str = "native", tokenizer: str | None = None) -> Path:
    """Write `checkpoint` to `out`; with fmt "hf", also the run's tokenizer (or `tokenizer`, a directory
    checked against the one the run records) where it has a transformers form."""
    out = Path(out)
    if fmt not in ("native", "hf"):
        raise RecipeError(f"--format must be native or hf, got {fmt!r}")
    if tokenizer is not None and fmt != "hf":
        raise RecipeError(
            "--tokenizer is written beside HuggingFace weights only. Fix: add --format hf, or drop --tokenizer"
        )
    if fmt == "native":
        model, meta = load_for_eval(checkpoint)
        return save_native(model, out, meta)
    model, info = load_checkpoint(checkpoint)
    tok = pick_tokenizer(tokenizer, model, info)  # refuses a tokenizer the run was not trained with
    export_hf(model, out, eos_id=getattr(tok, "eos_id", None))
    (out / "trainer_meta.json").write_text(json.dumps(info["meta"], indent=1, default=str))
    hf = tok.hf_tokenizer() if tok is not None and hasattr(tok, "hf_tokenizer") else None
    if hf is None:
        print(f"no tokenizer exported: {no_tokenizer_reason(tok, info)}")
        return out
    hf.save_pretrained(out)
    print(f"wrote the run's tokenizer ({tok.kind}, {tok.identity}) beside the weights")
    return out


def no_tokenizer_reason(tok, info: dict) -> str:
    """Why an HF export has no tokenizer, and what gives it one."""
    if tok is not None:  # found, but bytes or tiktoken
        name = tok.kind if tok.identity == tok.kind else f"{tok.kind} {tok.path} (identity {tok.identity})"
        return f"the run's tokenizer, {name}, has no transformers form"
    want = info.get("tokenizer_id")
    if not want:
        return (
            "the checkpoint records no tokenizer. To ship one, export again with --tokenizer DIR "
            "(the tokenizer the model was trained with)"
        )
    if str(want).startswith("synthetic:"):
        return (
            f"the run has no tokenizer (it trained on the token ids of a synthetic task, {want}, not on text). "
            "To ship one, train on text prepared with a tokenizer (python -m data_pipeline.prepare) and export that run"
        )
    return (
        f"the run's tokenizer {want} was not found where its recipe points (data.tokenizer or the shards' "
        "manifest). To ship it, export again with --tokenizer DIR (that tokenizer)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m pretrain.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="tag dir, run dir, or native dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", choices=("native", "hf"), default="native")
    ap.add_argument(
        "--tokenizer",
        help="with --format hf: the tokenizer dir to write beside the weights (default: the one the run records)",
    )
    args = ap.parse_args(argv)

    def body() -> None:
        out = export(args.checkpoint, args.out, args.format, args.tokenizer)
        print(f"wrote {args.format} checkpoint to {out}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
