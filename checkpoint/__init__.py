"""The checkpoint layer: every format this repository reads or writes, below both the trainer
and the evaluation harness.

- `tag_format`: training tag dirs (DeepSpeed files for ZeRO 0-3 and pipeline layer files, frozen
  tensors as safetensors, RNG states), the `COMPLETE` marker (fsynced files, listed with
  their sizes and checksums, verified on resume), `latest`, retention;
- `pickle_scan`: the scan that refuses a pickle importing code, and weights-only loading of
  the file that was scanned (also inside DeepSpeed's loaders: `guarded_torch_load`);
- `guarded_run`: runs DeepSpeed's universal-checkpoint converter under that guard;
- `consolidate`: one model (or classifier) from a tag dir, whatever layout wrote it;
- `load`: `load_for_eval` for native, HF, tag and run dirs, and a run's checkpoints by step.

It imports `model/` (to build the network) and `data_pipeline/` (a classifier's pad id), and
nothing from `pretrain/` or `eval/`.
"""

from .load import load_for_eval, run_checkpoints

__all__ = ["load_for_eval", "run_checkpoints"]
