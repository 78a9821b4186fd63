"""Data-parallel eval on CPU: 2 real processes (gloo) give the same numbers as 1 process."""

import pytest
import torch
import torch.multiprocessing as mp

from common.constants import free_port
from eval import distributed as D
from eval.perplexity import perplexity
from model import preset
from model.io import load_native, save_native
from model.transformer import build_model


def _worker(rank, world, port, ck, ids, out):
    torch.set_num_threads(1)
    D.init(rank, world, port)
    try:
        model, _ = load_native(ck)
        model.eval()
        res = perplexity(model, ids, window=24, stride=10, batch_size=2, progress=False)
        if rank == 0:
            out.put(res)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    torch.set_num_threads(1)
    model = build_model(preset("tiny", variant="frozen_qk", vocab_size=80, max_seq_len=32), seed=4).eval()
    save_native(model, tmp_path / "ck", {"step": 1})
    ids = torch.randint(0, 80, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    single = perplexity(model, ids, window=24, stride=10, batch_size=2, progress=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path / "ck"), ids, q), nprocs=2, join=True)
    multi = q.get(timeout=30)
    assert multi == single  # bit-identical: same batches, reduced in window order


def test_my_batches_partition():
    assert D.my_batches(list("abc")) == [(0, "a"), (1, "b"), (2, "c")]  # single process: all
    assert D.gather_ordered([(2, "c"), (0, "a")]) == ["a", "c"]
