"""Regenerate the local JSONL data of the offline lm-eval tasks (deterministic).

python -m eval.tasks.make_data
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "data"
LETTERS = "abcdefghij"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TEXT = [
    "The river runs past the old mill and under the stone bridge before it reaches the sea.",
    "In the morning the market fills with people buying bread, fruit and fresh fish.",
    "A small boat drifted along the coast while the sailors mended their nets.",
    "The library keeps its oldest books in a quiet room at the top of the tower.",
    "Snow fell all night, and by dawn the village was white and silent.",
    "She wrote a long letter to her brother, who lived far away in the mountains.",
    "The children counted the stars until they fell asleep in the warm grass.",
    "Every autumn the birds gather on the wires before they fly south together.",
]


def kv_recall(n: int = 40, pairs: int = 4, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        keys = r.sample(LETTERS, pairs)
        vals = [r.randrange(10) for _ in keys]
        q = r.randrange(pairs)
        ctx = ", ".join(f"{k}={v}" for k, v in zip(keys, vals)) + f". {keys[q]}="
        rows.append({"context": ctx, "choices": [str(d) for d in range(10)], "answer": vals[q]})
    return rows


def passkey(n: int = 10, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        key = r.randrange(10000, 100000)
        depth = r.choice([0, 1, 2])
        parts = [FILLER] * 3
        parts.insert(depth, f"The pass key is {key}. Remember it. ")
        rows.append({"context": "".join(parts) + "What is the pass key? The pass key is", "answer": f" {key}"})
    return rows


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for name, rows in (("kv_recall", kv_recall()), ("passkey", passkey()), ("text", [{"text": t} for t in TEXT])):
        with open(HERE / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
