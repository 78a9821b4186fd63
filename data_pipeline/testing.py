"""Small local fixtures shared by the data tests and benchmarks (no network, no big files).

Real text comes from the wikitext-2 copy next to the repository when it exists; otherwise
a deterministic generated corpus stands in, so the tests run anywhere.
"""
from __future__ import annotations

import random
from pathlib import Path

WIKITEXT_DIR = Path(__file__).resolve().parents[1].parent / "shared/data/wikitext-2"

_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
          "have an they you were her she there been one all we their has would when if so no what up out "
          "lobster ocean river city music model data train token shard memory order seed epoch").split()


def corpus_lines(n_lines: int, split: str = "valid") -> list[str]:
    """``n_lines`` non-empty lines of real text (wikitext-2 if present, else generated)."""
    path = WIKITEXT_DIR / f"{split}.txt"
    if path.is_file():
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if len(lines) >= n_lines:
            return lines[:n_lines]
    rng = random.Random(split)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 120))) + " ." for _ in range(n_lines)]


def write_text(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_tokenizer(out: Path, vocab_size: int = 400, n_lines: int = 1500) -> Path:
    """Train a small SentencePiece tokenizer on local text (about a second)."""
    from .tokenizer import train_sentencepiece

    src = write_text(Path(out) / "_train.txt", corpus_lines(n_lines))
    train_sentencepiece([str(src)], vocab_size, out, quiet=True)
    return Path(out)
