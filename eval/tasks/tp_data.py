"""The data of the bundled lm-eval tasks, read from beside this file rather than the working directory, so
the tasks run from anywhere: each task's YAML names its loader (`custom_dataset: !function tp_data.NAME`),
which lm-eval imports from the YAML's own directory. Imports nothing of the project, since lm-eval's own CLI
may load it without the repository on the path (`lm_eval --include_path .../eval/tasks`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

DATA = Path(__file__).resolve().parent / "data"


def _split(name: str) -> dict[str, datasets.Dataset]:
    lines = (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}


def kv_recall(**_: Any) -> dict[str, datasets.Dataset]:
    return _split("kv_recall")


def passkey(**_: Any) -> dict[str, datasets.Dataset]:
    return _split("passkey")


def text(**_: Any) -> dict[str, datasets.Dataset]:
    return _split("text")
