"""Convert a checkpoint to DeepSpeed's universal format, to resume under another layout.

    python -m pretrain.universal --checkpoint RUN/checkpoints/step_00000100 --out RUN/universal
    python -m pretrain.train --recipe R.yaml --resume RUN/universal/step_00000100 [new layout overrides]

The input is verified against its marker and every pickle in it scanned first; DeepSpeed's
`ds_to_universal` (which needs the `UNIVERSAL_CHECKPOINT_INFO` client state every checkpoint of
pretrain.train carries) runs under `checkpoint.guarded_run`, reading each file weights-only from the
same open file that was scanned. The trainer's own files follow (trainer_state.json marked universal,
the frozen tensors; not the per-rank RNG files, re-seeded on resume) and the result is marked
complete (docs/TRAINING.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from checkpoint import tag_format as ckpt
from checkpoint.pickle_scan import verify_checkpoint_dir
from common.cli import CliParser, run_cli
from common.constants import REPO_ROOT, atomic_write
from common.errors import RunStopped


def to_universal(tag_dir: str | Path, out_root: str | Path, workers: int = 1) -> Path:
    tag_dir = Path(tag_dir)
    if not ckpt.is_complete(tag_dir):
        raise FileNotFoundError(f"{tag_dir} is not a complete checkpoint")
    problems = ckpt.verify(tag_dir)
    if problems:
        raise FileNotFoundError(
            f"{tag_dir} fails verification ({'; '.join(problems[:3])}). Fix: convert an earlier checkpoint"
        )
    verify_checkpoint_dir(tag_dir)  # a crafted pickle is refused here, with its name
    out = Path(out_root) / tag_dir.name
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "checkpoint.guarded_run", "deepspeed.checkpoint.ds_to_universal"]
    cmd += ["--input_folder", str(tag_dir), "--output_folder", str(out)]
    cmd += ["--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]
    print("+ " + " ".join(cmd), flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    subprocess.run(cmd, check=True, env=env)
    for f in tag_dir.glob("frozen-stage*.safetensors"):
        shutil.copy2(f, out / f.name)
    state = ckpt.read_state(tag_dir)
    state["universal"] = True
    state["converted_from"] = str(tag_dir)
    atomic_write(out / ckpt.STATE, json.dumps(state, indent=1, sort_keys=True, default=str))
    ckpt.mark_complete(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m pretrain.universal", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a tag dir (RUN/checkpoints/step_N) or a run dir (latest)")
    ap.add_argument("--out", required=True, help="directory that receives <tag>/")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args(argv)

    def body() -> None:
        src = Path(args.checkpoint)
        if not ckpt.is_complete(src):
            latest = ckpt.latest_checkpoint(src) if src.is_dir() else None
            if latest is None:
                raise FileNotFoundError(
                    f"no complete checkpoint at {src}. Fix: pass a tag dir "
                    "(RUN/checkpoints/step_N with a COMPLETE marker) or a run dir"
                )
            src = latest
        verify_checkpoint_dir(src)  # refuse a crafted pickle before DeepSpeed unpickles anything
        try:
            out = to_universal(src, args.out, args.workers)
        except subprocess.CalledProcessError as e:
            raise RunStopped(f"DeepSpeed's converter failed on {src} (its output is above): {e}") from e
        print(f"universal checkpoint: {out}\nresume with: python -m pretrain.train --recipe R.yaml --resume {out}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
