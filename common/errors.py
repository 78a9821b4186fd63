"""The project's one error family.

Two kinds, and CLIs catch only these two (plus OSError, which names the path a user gave):
- `UserError`: bad input a person can fix before anything expensive runs. Its message says what
  is wrong and, after `Fix:`, what to do; a CLI prints it as one `error:` line and exits 2.
- `RunStopped`: a run that started had to stop (non-finite loss, a dead rank, a full disk, data
  that became unreadable); the last complete checkpoint is intact. A CLI exits 3.
Each layer raises the subclass that names where the problem lies.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str], n: int = 1) -> str:
    """ "did you mean 'x'? " (up to `n` of the closest `choices` to `word`), or "" when none is close: the
    hint of every unknown-name error."""
    close = difflib.get_close_matches(word, list(choices), n=n)
    return f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""


class UserError(ValueError):
    """Bad input a user can fix; the message ends with `Fix: ...` where the fix is not obvious."""


class RunStopped(RuntimeError):
    """A started run had to stop; everything up to its last complete checkpoint is kept."""


class ConfigError(UserError):
    """A model configuration value is invalid."""


class DataError(UserError):
    """A data input is missing, corrupt or inconsistent with the training config."""


class RecipeError(UserError):
    """A recipe value is missing, unknown or inconsistent."""


class CorruptCheckpoint(UserError):
    """A checkpoint file exists but cannot be parsed (truncated, overwritten, not what its name says)."""


class UnsafeCheckpoint(UserError):
    """A checkpoint file would import something outside the allowlist when unpickled."""


class EvalError(UserError):
    """A bad checkpoint path, tokenizer mismatch, unknown task, ..."""


class PreflightError(UserError):
    """A node is not ready for a multi-node job: unreachable, another commit or environment, a run dir it
    does not share, too few GPUs or too little disk, no route to the rendezvous port, no such interface."""


class RendezvousError(UserError):
    """The ranks of a job could not meet: rank 0's port is held by another program, a rank never arrived or
    refused its input, or the ranks could not connect to each other."""


class NodesDisagree(UserError):
    """The ranks of one job were given different recipes, code, package versions or world sizes."""


class StudyError(UserError):
    """A study's option or input is wrong (an unknown variant, nothing to collect, ...), or a run failed."""


class NonFiniteLoss(RunStopped):
    """The loss was NaN/inf and the policy (or the repeat limit) says stop."""


class RankFailure(RunStopped):
    """A collective failed or timed out: another rank died or hangs."""


class CheckpointWriteFailed(RunStopped):
    """Writing a checkpoint failed (e.g. no space left); earlier checkpoints are untouched."""
