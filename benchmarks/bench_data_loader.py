"""Sequences/s of the loader alone (no model): shard data and a synthetic task.

    .venv/bin/python benchmarks/bench_data_loader.py [--seq-len 2048] [--batch 32] [--steps 200]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from data_pipeline import DataConfig, build_loader  # noqa: E402
from data_pipeline.prepare import prepare  # noqa: E402
from data_pipeline.testing import WIKITEXT_DIR, corpus_lines, write_text  # noqa: E402
from data_pipeline.tokenizer import train_sentencepiece  # noqa: E402


def run(loader, steps: int) -> tuple[float, float]:
    next(loader)
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        n += next(loader)["input_ids"].shape[0]
    dt = time.perf_counter() - t0
    return n / dt, n * loader.seq_len / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = [str(WIKITEXT_DIR / f"{s}.txt") for s in ("valid", "test") if (WIKITEXT_DIR / f"{s}.txt").is_file()]
        if not files:
            files = [str(write_text(tmp / "gen.txt", corpus_lines(40_000)))]
        tok = train_sentencepiece(files, 8000, tmp / "tok", quiet=True)
        prepare(files, tok.path, tmp / "shards", shard_tokens=200_000, progress=False)
        print(f"{'source':<28}{'doc_ids':>8}{'seq_len':>8}{'seq/s':>12}{'tok/s':>14}")
        for doc_ids in (False, True):
            cfg = DataConfig(source=str(tmp / "shards"), return_doc_ids=doc_ids)
            ld = build_loader(cfg, split="train", seq_len=args.seq_len, global_batch_size=args.batch)
            s, t = run(ld, args.steps)
            print(f"{'wikitext-2 shards':<28}{str(doc_ids):>8}{args.seq_len:>8}{s:>12,.0f}{t:>14,.0f}")
        for task in ("kv_retrieval", "addition"):
            ld = build_loader(DataConfig(source=f"synthetic:{task}"), split="train", seq_len=64,
                              global_batch_size=args.batch)
            s, t = run(ld, args.steps)
            print(f"{'synthetic:' + task:<28}{'False':>8}{64:>8}{s:>12,.0f}{t:>14,.0f}")


if __name__ == "__main__":
    main()
