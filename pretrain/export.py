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
from model.io import save_native


def export(checkpoint: str | Path, out: str | Path, fmt: str = "native") -> Path:
    model, meta = load_for_eval(checkpoint)
    out = Path(out)
    if fmt == "native":
        return save_native(model, out, meta)
    if fmt == "hf":
        from model.hf import export_hf  # deferred: heavy (transformers)

        export_hf(model, out)
        (out / "trainer_meta.json").write_text(json.dumps(meta, indent=1, default=str))
        return out
    raise ValueError(f"--format must be native or hf, got {fmt!r}")


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
