"""Tokens/s the loader delivers per rank (no model) against what a 1B model consumes per H100.

    .venv/bin/python benchmarks/bench_data_loader.py [--seq-len 2048] [--rank-batch 8] [--steps 100]

The corpus is 64M random tokens in the shard format (the loader's cost does not depend on what the
ids mean), large enough that cold remote reads stay cold. Columns: tokens/s in a tight loop, and the
time a training step waits for its batch when each step takes as long as a 1B model's step at 45%
MFU on an H100 (the loader's work either runs inside the step or, prefetched, beside it). The rows
and what they show: docs/TRAINING.md, Loader throughput.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from data_pipeline import DataConfig  # noqa: E402
from data_pipeline.loader import build_loader  # noqa: E402
from data_pipeline.shards import FORMAT_VERSION, MANIFEST, atomic_write_json, write_shard  # noqa: E402
from studies.static_server import http_server  # noqa: E402

H100_BF16_DENSE_TFLOPS = 989.4  # H100 SXM, dense bf16 tensor-core peak
MFU = 0.45


def need_tokens_per_s(seq_len: int) -> tuple[float, str]:
    """Tokens/s one H100 consumes training a Llama-3.2-1B-shaped model at 45% MFU."""
    n_params, layers, d = 1.24e9, 16, 2048
    flops = 6 * n_params + 12 * layers * d * seq_len  # dense matmuls + attention scores, fwd+bwd
    tps = MFU * H100_BF16_DENSE_TFLOPS * 1e12 / flops
    how = (
        f"1B model (Llama-3.2-1B shape: 1.24e9 params, 16 layers, d=2048) at seq {seq_len}: "
        f"6N + 12*layers*d*seq = {flops:.3g} FLOPs/token; {MFU:.0%} x {H100_BF16_DENSE_TFLOPS} TFLOP/s "
        f"/ that = {tps:,.0f} tokens/s per GPU"
    )
    return tps, how


def per_row_fetch(src, idx, want_docs):
    """ShardSource.fetch as it was: one read (and doc-id lookup) per row in a Python loop."""
    L = src.seq_len
    n = len(idx)
    inp = np.empty((n, L), dtype=np.int64)
    lab = np.empty((n, L), dtype=np.int64)
    docs = np.zeros((n, L), dtype=np.int64) if want_docs else None
    for row, w in enumerate(idx):
        a = src.start + int(w) * L
        toks = src.shards.read(a, a + L + 1)
        inp[row] = toks[:-1]
        lab[row] = toks[1:]
        if want_docs:
            d = src.shards.doc_ids(a, a + L)
            docs[row] = d - d[0]
    return inp, lab, docs


def synthetic_shards(out: Path, n_tokens: int, shard_tokens: int, vocab: int = 32000, seed: int = 0) -> dict:
    """A prepared directory of random tokens and document lengths (no tokenizer: the loader's
    work does not depend on what the ids mean), written with the format's own writer."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    shards = []
    for i, a in enumerate(range(0, n_tokens, shard_tokens)):
        n = min(shard_tokens, n_tokens - a)
        lens = rng.geometric(1 / 600, size=n // 100 + 2)
        cut = np.cumsum(lens)
        offsets = np.concatenate([[0], cut[cut < n], [n]]).astype(np.int64)
        shards.append(write_shard(out, i, rng.integers(0, vocab, n, dtype=np.uint16), offsets))
    m = {
        "format_version": FORMAT_VERSION,
        "complete": True,
        "tokenizer_id": "bench:random",
        "vocab_size": vocab,
        "dtype": "uint16",
        "eos_id": 0,
        "pad_id": 0,
        "num_tokens": n_tokens,
        "num_docs": sum(s["num_docs"] for s in shards),
        "shards": shards,
    }
    atomic_write_json(out / MANIFEST, m)
    return m


def make(source: str, seq_len: int, rank_batch: int, *, prefetch: int, per_row: bool = False, **kw):
    # rank 0 of 8 data-parallel ranks: its share of each global batch is rank_batch rows
    cfg = DataConfig(source=source, prefetch=prefetch, **kw)
    ld = build_loader(cfg, split="train", seq_len=seq_len, global_batch_size=8 * rank_batch, dp_rank=0, dp_world_size=8)
    if per_row:
        for s in ld.sources:
            s.fetch = types.MethodType(per_row_fetch, s)
    return ld


def tight(make_loader, steps: int, repeats: int = 1) -> float:
    """Tokens/s with nothing else to do, best of ``repeats`` fresh loaders (cold reads count)."""
    best = 0.0
    for _ in range(repeats):
        ld = make_loader()
        t0 = time.perf_counter()
        n = sum(next(ld)["input_ids"].numel() for _ in range(steps))
        best = max(best, n / (time.perf_counter() - t0))
        ld.close()
    return best


def stall(ld, steps: int, step_s: float) -> float:
    """Mean seconds a step waits in next() when each step computes for step_s."""
    next(ld)
    waited = 0.0
    for _ in range(steps):
        time.sleep(step_s)  # the model's step (sleep releases the GIL, as CUDA work does)
        t0 = time.perf_counter()
        next(ld)
        waited += time.perf_counter() - t0
    ld.close()
    return waited / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rank-batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--stall-steps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=64 << 20, help="corpus size (random tokens)")
    args = ap.parse_args()
    L, B = args.seq_len, args.rank_batch
    need, how = need_tokens_per_s(L)
    step_s = B * L / need
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        srv_root = tmp / "srv"
        m = synthetic_shards(srv_root / "shards", args.tokens, 16 << 20)
        local = str(srv_root / "shards")
        print(
            f"corpus: {m['num_tokens']:,} random tokens ({m['num_tokens'] * 2 / 2**20:.0f} MiB) in "
            f"{len(m['shards'])} shards, {m['num_docs']:,} documents; {os.cpu_count()} CPU cores"
        )
        print(f"need: {how}")
        print(f"one training step of {B} x {L} tokens per GPU = {step_s * 1e3:.0f} ms of compute\n")
        print(f"{'source / loader':<48}{'rows x seq':>11}{'tokens/s':>14}{'vs need':>9}{'wait/step':>12}{'of step':>9}")
        rows = []

        def row(name, shape, tps, wait=None):
            rows.append((name, tps))
            w = "" if wait is None else f"{wait * 1e3:>9.2f} ms{wait / step_s:>9.2%}"
            t = f"{tps:>14,.0f}{tps / need:>8,.0f}x" if not math.isnan(tps) else f"{'-':>14}{'-':>9}"
            print(f"{name:<48}{shape:>11}{t}{w}", flush=True)

        for rb, sl in ((B, L), (64, 256)):
            for doc_ids in (False, True):
                sfx = " +doc_ids" if doc_ids else ""
                for name, kw in (
                    (f"local, per-row loop, sync (before){sfx}", dict(prefetch=0, per_row=True)),
                    (f"local, vectorised, sync{sfx}", dict(prefetch=0)),
                    (f"local, vectorised, prefetch 2 (after){sfx}", dict(prefetch=2)),
                ):
                    mk = functools.partial(make, local, sl, rb, return_doc_ids=doc_ids, **kw)
                    wait = stall(mk(), args.stall_steps, step_s) if sl == L else None
                    row(name, f"{rb}x{sl}", tight(mk, args.steps, repeats=3), wait)
        with http_server(srv_root) as srv:
            url = f"{srv.url}/shards"
            for kb in (64, 1024):
                cache = str(tmp / f"cache{kb}")
                mk = functools.partial(make, url, L, B, prefetch=0, cache_dir=cache, cache_block_kb=kb)
                for state in ("cold", "warm (node cache)"):  # the second pass reads the first one's cache
                    row(f"http {state}, block {kb} KiB, sync", f"{B}x{L}", tight(mk, args.steps))
            for prefetch, how in ((0, "sync"), (2, "prefetch 2")):
                cold = make(url, L, B, prefetch=prefetch, cache_dir=str(tmp / f"cache_p{prefetch}"), cache_block_kb=64)
                wait = stall(cold, args.stall_steps, step_s)
                row(f"http cold, block 64 KiB, {how}, in a step", f"{B}x{L}", float("nan"), wait)
        for task in ("kv_retrieval", "addition"):
            cfg = DataConfig(source=f"synthetic:{task}", prefetch=0)
            mk = functools.partial(build_loader, cfg, split="train", seq_len=64, global_batch_size=B)
            row(f"synthetic:{task}, sync", f"{B}x64", tight(mk, args.steps))
        worst = min((r for r in rows if not r[0].startswith("synthetic") and not math.isnan(r[1])), key=lambda r: r[1])
        print(
            f"\nslowest shard row: {worst[0]}: {worst[1]:,.0f} tokens/s per rank = {worst[1] / need:,.0f}x "
            "what one GPU consumes"
        )


if __name__ == "__main__":
    main()
