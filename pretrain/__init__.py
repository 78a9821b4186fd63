"""Pretraining under DeepSpeed: recipes, layouts, the training loop, checkpoints and export.

Entry points: `python -m pretrain.train`, `python -m pretrain.export`, `python -m pretrain.universal`;
in Python, `pretrain.train.train(recipe, overrides) -> RunResult` and
`checkpoint.load_for_eval(path) -> (model, meta)` (the checkpoint layer). See docs/TRAINING.md.
"""
