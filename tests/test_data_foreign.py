"""Token datasets other trainers wrote, read in place: a Megatron-LM indexed dataset (written by
megatron-core's own builder) and OLMo token arrays (.npy and raw) holding a prepared corpus's tokens
give the loader exactly the batches the prepared shards give, at any world size and after a resume;
weighted prefixes mix; bad files and missing recipe keys are one error before training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures import corpus_lines, make_tokenizer, write_text

from common.errors import DataError
from data_pipeline import DataConfig
from data_pipeline.foreign import ForeignShards
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare
from data_pipeline.shards import ShardSet, read_manifest
from pretrain.train import train

L = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared corpus and the same documents as a Megatron .bin/.idx pair and OLMo arrays."""
    root = tmp_path_factory.mktemp("foreign")
    tok = make_tokenizer(root / "tok")
    write_text(root / "a.txt", corpus_lines(300, "valid"))
    prepare([str(root / "a.txt")], tok, root / "A", shard_tokens=5_000, progress=False)
    manifest = read_manifest(root / "A")
    shards = ShardSet(root / "A")
    tokens = shards.read(0, shards.num_tokens)
    starts = np.concatenate([shards._offsets(i)[:-1] + shards.tok_starts[i] for i in range(len(shards.names))])
    docs = np.split(tokens, starts[1:])
    assert all(d[-1] == manifest["eos_id"] for d in docs)  # each document ends with EOS
    # deferred: heavy (megatron-core takes 4 s to import; every xdist worker would pay it at collection)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(root / "mega.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    builder.finalize(str(root / "mega.idx"))
    np.save(root / "olmo.npy", tokens.astype(np.uint32))
    tokens.astype(np.uint16).tofile(root / "olmo_raw.bin")
    keys = {"vocab_size": manifest["vocab_size"], "eos_id": manifest["eos_id"]}
    return root, tokens, starts, keys


def batches(cfg, W, steps, state=None):
    loaders = [
        build_loader(cfg, split="train", seq_len=L, global_batch_size=8, dp_rank=r, dp_world_size=W) for r in range(W)
    ]
    for ld in loaders:
        if state is not None:
            ld.load_state_dict(state)
    out = []
    for _ in range(steps):
        parts = [next(ld) for ld in loaders]
        out.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return out, loaders[0].state_dict()


@pytest.mark.parametrize("source", ["megatron:{root}/mega", "olmo:{root}/olmo.npy", "olmo:{root}/olmo_raw.bin"])
def test_foreign_tokens_give_the_prepared_shards_batches(corpus, source):
    root, tokens, starts, keys = corpus
    location = source.format(root=root)
    foreign = ForeignShards(location, keys["vocab_size"], keys["eos_id"], "uint16")
    assert np.array_equal(foreign.read(0, foreign.num_tokens), tokens)
    assert np.array_equal(
        foreign.doc_ids(0, foreign.num_tokens), np.searchsorted(starts, np.arange(len(tokens)), "right") - 1
    )
    ours = DataConfig(source=str(root / "A"), return_doc_ids=True)
    theirs = DataConfig(source=location, return_doc_ids=True, token_dtype="uint16", **keys)
    want, _ = batches(ours, 1, 6)
    for W in (1, 2):
        got, _ = batches(theirs, W, 6)
        for a, b in zip(want, got):
            for k in a:
                assert torch.equal(a[k], b[k]), (W, k)
    _, state = batches(theirs, 1, 3)  # resume after 3 steps: the next 3 batches
    resumed, _ = batches(theirs, 2, 3, state)
    for a, b in zip(want[3:], resumed):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_weighted_megatron_prefixes_train(corpus, tmp_path):
    root, _, _, keys = corpus
    mixture = [{"path": f"megatron:{root}/mega", "weight": 0.7}, {"path": f"olmo:{root}/olmo.npy", "weight": 0.3}]
    data = {"source": "mixture", "mixture": mixture, **keys}
    over = [f"data={data}", "train.max_steps=3", "checkpoint.every_steps=0", "logging.tensorboard=false"]
    result = train("recipes/tiny_cpu.yaml", over, run_dir=tmp_path / "run", resume="never")
    assert len(result.losses) == 3 and all(np.isfinite(list(result.losses.values())))


def test_foreign_sources_refused_before_training(corpus, tmp_path):
    root, tokens, _, keys = corpus
    with pytest.raises(DataError, match="Fix: set data.vocab_size and data.eos_id"):
        DataConfig(source=f"megatron:{root}/mega")
    small = {**keys, "vocab_size": int(tokens.max())}  # one id too few
    with pytest.raises(DataError, match=rf"token id {int(tokens.max())} >= data.vocab_size"):
        ForeignShards(f"megatron:{root}/mega", small["vocab_size"], 0)
    with pytest.raises(DataError, match="Fix: set data.token_dtype"):
        ForeignShards(f"olmo:{root}/olmo_raw.bin", keys["vocab_size"], keys["eos_id"])
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(DataError, match="no MMIDIDX header"):
        ForeignShards(f"megatron:{tmp_path}/bad", keys["vocab_size"], keys["eos_id"])
    cut = (root / "mega.bin").read_bytes()[:-2]
    (tmp_path / "cut.bin").write_bytes(cut)
    (tmp_path / "cut.idx").write_bytes((root / "mega.idx").read_bytes())
    with pytest.raises(DataError, match="contiguous tokens"):
        ForeignShards(f"megatron:{tmp_path}/cut", keys["vocab_size"], keys["eos_id"])
