"""Throughput of ``data_pipeline.prepare`` vs the plain ``datasets.map`` + tokenizer path.

Same input, same SentencePiece tokenizer, same output (a flat uint16 token file with EOS
after each document); one run of each, printed as a ratio table.

    .venv/bin/python benchmarks/bench_data_prepare.py [--repeat 4] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402  (reads HF_DATASETS_OFFLINE at import)

from data_pipeline.prepare import prepare  # noqa: E402
from data_pipeline.tokenizer import train_sentencepiece  # noqa: E402
from tests.fixtures import WIKITEXT_DIR, corpus_lines  # noqa: E402


@functools.cache
def _processor(sp_model: str) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=sp_model)  # once per worker process


def _tokenize(batch, sp_model: str):
    """datasets.map function: the usual per-batch tokenisation with EOS appended."""
    sp = _processor(sp_model)
    ids = sp.encode(batch["text"], out_type=int)
    return {"ids": [x + [sp.eos_id()] if t.strip() else [] for t, x in zip(batch["text"], ids)]}


def baseline(path: Path, sp_model: str, workers: int, out: Path) -> int:
    ds = datasets.load_dataset("text", data_files=[str(path)], split="train", cache_dir=str(out / "hf_cache"))
    ds = ds.map(
        _tokenize,
        batched=True,
        batch_size=512,
        num_proc=workers if workers > 1 else None,
        remove_columns=["text"],
        load_from_cache_file=False,
        fn_kwargs={"sp_model": sp_model},
    )
    flat = np.fromiter((t for row in ds["ids"] for t in row), dtype=np.uint16)
    flat.tofile(out / "baseline.bin")
    return len(flat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=4, help="copies of wikitext-2 valid+test in the input")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--vocab-size", type=int, default=8000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = []
        for split in ("valid", "test"):
            p = WIKITEXT_DIR / f"{split}.txt"
            lines += p.read_text(encoding="utf-8").splitlines() if p.is_file() else corpus_lines(20_000, split)
        src = tmp / "input.txt"
        src.write_text("\n".join(lines * args.repeat) + "\n", encoding="utf-8")
        tok = train_sentencepiece([str(src)], args.vocab_size, tmp / "tok", quiet=True)
        mb = src.stat().st_size / 1e6
        print(
            f"input: {mb:.1f} MB, {len(lines) * args.repeat} lines; tokenizer {tok.identity} vocab {tok.vocab_size}; "
            f"{os.cpu_count()} CPUs"
        )
        rows = []
        # Warm both paths' lazy imports (datasets streaming and arrow builders) before timing.
        warm = tmp / "warm.txt"
        warm.write_text("warm up\n")
        next(iter(datasets.load_dataset("text", data_files=[str(warm)], split="train", streaming=True)))
        datasets.load_dataset("text", data_files=[str(warm)], split="train", cache_dir=str(tmp / "warm_cache"))

        for k in args.workers:
            t0 = time.perf_counter()
            m = prepare([str(src)], tok.path, tmp / f"prep{k}", workers=k, progress=False)
            rows.append(("data_pipeline.prepare", k, m["num_tokens"], time.perf_counter() - t0))
            (tmp / f"base{k}").mkdir()
            t0 = time.perf_counter()
            n = baseline(src, str(Path(tok.path) / "tokenizer.model"), k, tmp / f"base{k}")
            rows.append(("datasets.map + tokenizer", k, n, time.perf_counter() - t0))
        print(f"\n{'method':<26}{'workers':>8}{'tokens':>12}{'seconds':>10}{'tok/s':>14}{'ratio':>8}")
        base = {w: t for name, w, _, t in rows if name.startswith("datasets")}
        for name, w, n, t in rows:
            print(f"{name:<26}{w:>8}{n:>12,}{t:>10.2f}{n / t:>14,.0f}{base[w] / t:>7.2f}x")
        print(
            "\nratio = baseline seconds / method seconds at the same worker count (one run each; "
            "prepare also writes checksummed shards, a document index and a manifest)."
        )


if __name__ == "__main__":
    main()
