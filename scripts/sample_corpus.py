"""Cut the repository's sample corpus (data/sample/) from the docs corpus: in file order, every whole
document that still fits its source's byte budget for the split. Deterministic.

    python scripts/sample_corpus.py ../shared/data/docs-corpus data/sample
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BUDGET = {"train": 480_000, "valid": 60_000}  # bytes of text per source and split
SOURCES = ("linux-doc", "python-doc", "gcide")


def cut(src: Path, out: Path, split: str) -> dict[str, int]:
    taken = dict.fromkeys(SOURCES, 0)
    with open(src / f"{split}.jsonl") as f, open(out / f"{split}.jsonl", "w") as w:
        for line in f:
            doc = json.loads(line)
            n = len(doc["text"].encode())
            if taken[doc["source"]] + n <= BUDGET[split]:
                taken[doc["source"]] += n
                w.write(line)
    return taken


def main(src: str, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    for split in BUDGET:
        print(split, cut(Path(src), Path(out), split))


if __name__ == "__main__":
    main(*sys.argv[1:3])
