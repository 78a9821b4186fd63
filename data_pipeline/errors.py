"""One exception type for every data problem a user can fix.

Why: the trainer catches ``DataError`` to print a one-paragraph message instead of a
stack trace; every message names the offending file/field and says how to fix it.
"""

from __future__ import annotations


class DataError(ValueError):
    """A data input is missing, corrupt or inconsistent with the training config."""
