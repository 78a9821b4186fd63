"""The bottom layer every package stands on: the one error family, the CLI error line, and the
constants and small helpers that would otherwise be written in each layer."""
