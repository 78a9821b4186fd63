"""Run a module (DeepSpeed's checkpoint converter) with every `torch.load` guarded.

    python -m checkpoint.guarded_run deepspeed.checkpoint.ds_to_universal --input_folder IN --output_folder OUT

DeepSpeed's tools unpickle checkpoint files in full (`weights_only=False`). Inside this
process each `torch.load` scans the file and loads it weights-only from the same open file
(`pickle_scan.guarded_torch_load`); worker processes forked by the tool inherit that.
"""

from __future__ import annotations

import sys

from common.deepspeed_import import run_module

from .pickle_scan import guarded_torch_load


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m checkpoint.guarded_run MODULE [ARGS ...]")
    with guarded_torch_load():
        run_module(argv[0], argv[1:])


if __name__ == "__main__":
    main()
