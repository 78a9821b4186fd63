"""Consolidate any checkpoint into one model directory (native or HuggingFace).

    python -m pretrain.export --checkpoint RUN/checkpoints/step_00000100 --out DIR [--format native|hf]

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
from eval.loading import load_checkpoint, run_tokenizer
from model.hf import export_hf
from model.io import save_native


def export(checkpoint: str | Path, out: str | Path, fmt: str = "native") -> Path:
    out = Path(out)
    if fmt == "native":
        model, meta = load_for_eval(checkpoint)
        return save_native(model, out, meta)
    if fmt == "hf":
        model, info = load_checkpoint(checkpoint)
        export_hf(model, out)
        (out / "trainer_meta.json").write_text(json.dumps(info["meta"], indent=1, default=str))
        export_tokenizer(info, out)
        return out
    raise RecipeError(f"--format must be native or hf, got {fmt!r}")


def export_tokenizer(info: dict, out: Path) -> None:
    """The run's tokenizer beside the weights, so `AutoTokenizer` and lm-eval's `hf` model load the
    directory alone; said plainly where the run's tokenizer has no transformers form."""
    tok = run_tokenizer(info)
    hf = tok.hf_tokenizer() if tok is not None and hasattr(tok, "hf_tokenizer") else None
    if hf is None:
        if tok is None:
            print("no tokenizer exported: the run records none (a synthetic task's ids, or a tokenizer not found)")
        else:
            print(
                f"no tokenizer exported: the run's {getattr(tok, 'kind', 'bytes')} tokenizer has no transformers form"
            )
        return
    hf.save_pretrained(out)
    print(f"wrote the run's tokenizer ({tok.kind}, {tok.identity}) beside the weights")


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m pretrain.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="tag dir, run dir, or native dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", choices=("native", "hf"), default="native")
    args = ap.parse_args(argv)

    def body() -> None:
        out = export(args.checkpoint, args.out, args.format)
        print(f"wrote {args.format} checkpoint to {out}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
