"""What the studies' CLIs report as one `error: ... Fix: ...` line instead of a traceback: their own
StudyError, the trainer's bad input and stopped runs, and the evaluation's errors."""

from __future__ import annotations

from eval.loading import EVAL_ERRORS
from pretrain.errors import INPUT_ERRORS, CheckpointWriteFailed, NonFiniteLoss, RankFailure


class StudyError(ValueError):
    """A study's option or input is wrong (an unknown variant, nothing to collect, ...), or a run failed."""


STUDY_ERRORS = (StudyError, *INPUT_ERRORS, *EVAL_ERRORS, NonFiniteLoss, CheckpointWriteFailed, RankFailure)
