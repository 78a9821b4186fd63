"""The trainer's user-facing errors. Each message says what happened and how to fix it;
`python -m pretrain.train` prints it as one `error:` line (exit 2 for bad input, 3 for a
run that had to stop); `INPUT_ERRORS` is what the pretrain CLIs report as bad input."""

from __future__ import annotations

from checkpoint import CorruptCheckpoint, UnsafeCheckpoint
from data_pipeline.cli import DATA_ERRORS


class RecipeError(ValueError):
    """A recipe value is missing, unknown or inconsistent; the message says how to fix it."""


class NonFiniteLoss(RuntimeError):
    """The loss was NaN/inf and the policy (or the repeat limit) says stop."""


class RankFailure(RuntimeError):
    """A collective failed or timed out: another rank died or hangs."""


class CheckpointWriteFailed(RuntimeError):
    """Writing a checkpoint failed (e.g. no space left); earlier checkpoints are untouched."""


# Bad input to a pretrain CLI: a recipe, a data problem, a missing/unreadable path, a corrupt or unsafe checkpoint.
INPUT_ERRORS = (RecipeError, CorruptCheckpoint, UnsafeCheckpoint, *DATA_ERRORS)
