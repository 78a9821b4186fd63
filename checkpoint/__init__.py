"""The checkpoint layer: every format this repository reads or writes, below both the trainer
and the evaluation harness (its modules: docs/TRAINING.md, "The checkpoint layer"). It imports
`model/` (to build the network) and `data_pipeline/` (a classifier's pad id), and nothing from
`pretrain/` or `eval/`.
"""

from .load import load_for_eval, run_checkpoints

__all__ = ["load_for_eval", "run_checkpoints"]
