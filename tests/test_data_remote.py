"""One loader suite over local, HTTP and S3 shards: same bytes, order and resume; corruption,
truncation and a server outage give clear errors naming the URL; the node cache stays bounded
and is safe for concurrent ranks.

The servers are real processes on loopback: aiohttp's web server (static files with Range
support) for HTTP, moto's server for the S3 protocol (tests/fixtures.py says why each).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec.config
import numpy as np
import pytest
import torch
from fixtures import (
    corpus_lines,
    http_server,
    make_tokenizer,
    s3_server,
    s3_storage_options,
    upload_dir,
    write_text,
)

from common.errors import DataError
from data_pipeline import DataConfig
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare
from data_pipeline.shards import ShardSet
from data_pipeline.storage import RemoteShardSet, ShardCache
from eval.perplexity import shard_stream

REPO = Path(__file__).resolve().parents[1]
L = 32
BACKENDS = ["local", "http", "s3"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Prepared directories under one root, served over HTTP and uploaded to S3."""
    root = tmp_path_factory.mktemp("remote")
    srv = root / "srv"
    tok = make_tokenizer(root / "tok")
    write_text(root / "a.txt", corpus_lines(400, "valid"))
    write_text(root / "b.txt", corpus_lines(300, "test"))
    prepare([str(root / "a.txt")], tok, srv / "A", shard_tokens=7_000, progress=False)
    prepare([str(root / "b.txt")], tok, srv / "B", shard_tokens=7_000, progress=False)
    bad = {
        "flip": ("shard_00000.bin", lambda b: b[:123] + bytes([b[123] ^ 1]) + b[124:]),
        "trunc": ("shard_00001.bin", lambda b: b[:-10]),
    }
    for name, (f, change) in bad.items():
        shutil.copytree(srv / "A", srv / name)
        (srv / name / f).write_bytes(change((srv / name / f).read_bytes()))
    http = http_server(srv)
    s3 = s3_server()
    opts = s3_storage_options(s3)
    for d in ("A", "B", "flip", "trunc"):
        upload_dir(srv / d, f"s3://shards/{d}", opts)
    yield {"root": root, "srv": srv, "tok": tok, "http": http, "s3": s3, "s3_opts": opts}
    http.stop()
    s3.stop()


def where(served, backend: str, name: str) -> str:
    return {"local": str(served["srv"] / name), "http": f"{served['http'].url}/{name}", "s3": f"s3://shards/{name}"}[
        backend
    ]


def cfg_for(served, backend, tmp_path, source=None, mixture=None, **kw) -> DataConfig:
    if backend == "s3":
        kw.setdefault("storage_options", served["s3_opts"])
    if backend != "local":
        kw.setdefault("cache_dir", str(tmp_path / f"cache-{backend}"))
        kw.setdefault("cache_block_kb", 2)  # several blocks per shard; windows straddle blocks
    return DataConfig(source=source or "mixture", mixture=mixture, **kw)


def loader(cfg, split="train", W=1, r=0, gbs=8):
    return build_loader(cfg, split=split, seq_len=L, global_batch_size=gbs, dp_rank=r, dp_world_size=W)


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def global_batches(make, W, steps, state=None):
    lds = [make(W, r) for r in range(W)]
    if state is not None:
        for ld in lds:
            ld.load_state_dict(state)
    return [
        {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        for parts in ([next(ld) for ld in lds] for _ in range(steps))
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_bytes_order_and_val_split_as_local(served, backend, tmp_path):
    local = lambda W, r: loader(DataConfig(source=str(served["srv"] / "A"), return_doc_ids=True, prefetch=0), W=W, r=r)  # noqa: E731
    ref = global_batches(local, 1, 5)

    def remote(W, r):
        return loader(cfg_for(served, backend, tmp_path, where(served, backend, "A"), return_doc_ids=True), W=W, r=r)

    same(ref, global_batches(remote, 2, 5))
    # a mixture of two remote components, and the validation split in stream order
    mix = lambda b, src: [{"path": src(b, "A"), "weight": 2}, {"path": src(b, "B"), "weight": 1}]  # noqa: E731
    lmix = loader(
        DataConfig(source="mixture", mixture=mix("local", lambda b, n: where(served, b, n)), val_fraction=0.1)
    )
    rmix = loader(
        cfg_for(served, backend, tmp_path, mixture=mix(backend, lambda b, n: where(served, b, n)), val_fraction=0.1)
    )
    same([next(lmix) for _ in range(4)], [next(rmix) for _ in range(4)])
    assert lmix.state_dict()["fingerprint"] == rmix.state_dict()["fingerprint"]
    lval = loader(DataConfig(source=str(served["srv"] / "B"), val_fraction=0.2), split="val", gbs=4)
    rval = loader(cfg_for(served, backend, tmp_path, where(served, backend, "B"), val_fraction=0.2), split="val", gbs=4)
    same(list(lval.iter_epoch()), list(rval.iter_epoch()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_moves_between_local_and_remote(served, backend, tmp_path):
    local = loader(DataConfig(source=str(served["srv"] / "A"), return_doc_ids=True), gbs=6)
    for _ in range(5):
        next(local)
    state = json.loads(json.dumps(local.state_dict()))
    rest = [next(local) for _ in range(4)]
    remote = loader(cfg_for(served, backend, tmp_path, where(served, backend, "A"), return_doc_ids=True), gbs=6)
    remote.load_state_dict(state)  # a local run's checkpoint continues on remote storage
    same(rest, [next(remote) for _ in range(4)])
    back = loader(DataConfig(source=str(served["srv"] / "A"), return_doc_ids=True), gbs=6)
    back.load_state_dict(remote.state_dict())  # ... and back
    same([next(local) for _ in range(3)], [next(back) for _ in range(3)])


def _read_everything(ld):
    """One batch holding every training window: every block of every shard is read."""
    big = loader(ld.cfg, gbs=ld.num_sequences)
    return next(big)


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_shard_is_named(served, backend, tmp_path):
    cfg = cfg_for(served, backend, tmp_path, where(served, backend, "flip"))
    with pytest.raises(DataError, match=r"shard_00000\.bin fails its sha256 check"):
        _read_everything(loader(cfg))  # local: at start-up; remote: once the shard is cached whole
    if backend != "local":
        assert not any((Path(cfg.cache_dir)).rglob("whole/shard_00000.bin"))  # never kept, never mapped


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_shard_is_named(served, backend, tmp_path):
    cfg = cfg_for(served, backend, tmp_path, where(served, backend, "trunc"))
    url = where(served, backend, "trunc")
    with pytest.raises(DataError, match=rf"shard {url}/shard_00001\.bin has \d+ bytes but .*truncated"):
        _read_everything(loader(cfg))


@pytest.mark.parametrize("backend", ["http", "s3"])
def test_server_outage_retries_then_names_url_and_recovers(served, backend, tmp_path, monkeypatch):
    """A dedicated server goes away mid-run: cached data keeps flowing, then retries with backoff,
    then a DataError naming the URL; the loader's position is untouched, so once the server is
    back the same batches follow. A server back within the backoff window is not noticed at all."""
    data = served["srv"] / "A"
    if backend == "http":
        srv = http_server(served["srv"])
        opts, url = None, f"{srv.url}/A"
        restore = srv.start
    else:
        import s3fs  # deferred: heavy (aiobotocore)

        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # our loop does the retrying, and times it
        srv = s3_server()
        opts, url = s3_storage_options(srv, fast_fail=True), "s3://outage/A"
        upload_dir(data, url, opts)

        def restore():
            srv.start()
            upload_dir(data, url, opts)  # moto keeps its objects in memory

    try:
        ref = loader(DataConfig(source=str(data)), gbs=8)
        cfg = cfg_for(served, backend, tmp_path, url, storage_options=opts, retries=3, retry_backoff_s=0.2)
        ld = loader(cfg, gbs=8)
        got = [next(ld), next(ld)]
        t0 = time.monotonic()  # before the stop: the prefetch thread may fail (and start backing off) at once
        srv.stop()
        with pytest.raises(DataError) as err:
            for _ in range(200):  # cached blocks and prefetched batches come first
                got.append(next(ld))
        waited = time.monotonic() - t0
        msg = str(err.value)
        assert url in msg and "after 4 attempts" in msg and "--resume auto" in msg, msg
        assert waited >= 0.2 + 0.4 + 0.8  # backed off 1x, 2x, 4x
        same([next(ref) for _ in got], got)  # everything delivered before the error was right
        pos = ld.samples_seen
        restore()
        same([next(ref) for _ in range(3)], [next(ld) for _ in range(3)])  # same place, same batches
        assert ld.samples_seen == pos + 24
        if backend == "s3":
            return  # moto restarts empty: a restart inside the backoff would serve "no such bucket"
        # an outage shorter than the backoff: nobody notices (the window, 0.5 s doubling over 6 retries,
        # 31.5 s in all, leaves room for a restart on a loaded machine; a server that is back ends it)
        srv.stop()
        timer = threading.Timer(0.3, restore)
        timer.start()
        fresh = loader(
            cfg_for(
                served,
                backend,
                tmp_path,
                url,
                storage_options=opts,
                retries=6,
                retry_backoff_s=0.5,
                cache_dir=str(tmp_path / "cold"),
            ),
            gbs=8,
        )
        fresh.load_state_dict(ld.state_dict())
        same([next(ref) for _ in range(3)], [next(fresh) for _ in range(3)])
        timer.join()
    finally:
        srv.stop()


def test_outage_during_a_size_check_is_retried_not_missing(served, tmp_path):
    srv = http_server(served["srv"])
    manifest = (served["srv"] / "A" / "manifest.json").read_bytes()
    shards = RemoteShardSet(
        f"{srv.url}/A", cache_dir=tmp_path / "c", retries=1, backoff_s=0.05, manifest_bytes=manifest
    )
    srv.stop()  # the first read of a shard checks its size (HEAD) first
    with pytest.raises(DataError, match=rf"cannot read {srv.url}/A/shard_00000\.bin \(size\) after 2 attempts"):
        shards.gather([0], L)


def test_missing_manifest_and_bad_scheme(served, tmp_path):
    with pytest.raises(DataError, match=r"/nothing/manifest\.json was not found on the server\. Fix: upload the whole"):
        loader(cfg_for(served, "http", tmp_path, f"{served['http'].url}/nothing"))
    with pytest.raises(DataError, match="install the fsspec backend for nope://"):
        loader(DataConfig(source="nope://bucket/x"))
    with pytest.raises(DataError, match="storage_options must be a mapping"):
        DataConfig(source="s3://b/x", storage_options="endpoint")


def test_cache_is_bounded_and_whole_shards_are_memory_mapped(served, tmp_path):
    url = f"{served['http'].url}/A"
    local = ShardSet(served["srv"] / "A")
    full = RemoteShardSet(url, cache_dir=tmp_path / "c1", block_bytes=2048)
    assert np.array_equal(full.read(0, full.num_tokens), local.read(0, local.num_tokens))
    whole = sorted(p.name for p in (full.cache.dir / "whole").glob("*.bin"))
    assert whole == [f"{n}.bin" for n in local.names]  # every shard joined, sha256-checked
    assert not any((full.cache.dir / "blocks").iterdir())  # ... and its blocks dropped
    assert isinstance(full._bin(0), np.memmap)
    limit = 20_000  # bytes: a fraction of the 88 kB corpus
    small = RemoteShardSet(url, cache_dir=tmp_path / "c2", block_bytes=2048, cache_max_bytes=limit)
    starts = np.random.default_rng(0).integers(0, local.num_tokens - L, 300)
    assert np.array_equal(small.gather(starts, L + 1), local.gather(starts, L + 1))
    small.cache.evict()
    held = sum(p.stat().st_size for p in (tmp_path / "c2").rglob("*") if p.is_file())
    assert 0 < held <= limit


_RANK_SCRIPT = """
import sys, numpy as np
from data_pipeline.storage import RemoteShardSet
from data_pipeline.shards import ShardSet
url, local, cache, seed = sys.argv[1:5]
ref = ShardSet(local)
r = RemoteShardSet(url, cache_dir=cache, block_bytes=1024)
starts = np.random.default_rng(int(seed)).integers(0, ref.num_tokens - 40, 2000)
for chunk in np.array_split(starts, 40):
    assert np.array_equal(r.gather(chunk, 40), ref.gather(chunk, 40))
    assert np.array_equal(r.gather_doc_ids(chunk, 40), ref.gather_doc_ids(chunk, 40))
print("ok")
"""


def test_node_cache_shared_by_concurrent_ranks(served, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RANK_SCRIPT,
                f"{served['http'].url}/A",
                str(served["srv"] / "A"),
                str(tmp_path / "shared"),
                str(seed),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert not list((tmp_path / "shared").rglob("*.tmp*"))


@pytest.mark.parametrize("backend", ["http", "s3"])
def test_eval_val_dir_reads_remote_shards(served, backend, monkeypatch):
    local, _ = shard_stream(served["srv"] / "B")
    # eval.run takes fsspec options from fsspec's config (FSSPEC_S3_ENDPOINT_URL=... in the environment)
    monkeypatch.setitem(
        fsspec.config.conf, "s3", {"endpoint_url": served["s3"].url, "key": "testing", "secret": "testing"}
    )
    remote, _ = shard_stream(where(served, backend, "B"))
    assert np.array_equal(local, remote)


def test_missing_credentials_is_not_retried(served, tmp_path, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"access to s3://shards/A/manifest\.json was refused .*credentials"):
        loader(
            DataConfig(
                source="s3://shards/A",
                storage_options={"endpoint_url": served["s3"].url},
                cache_dir=str(tmp_path / "c"),
            )
        )
    assert time.monotonic() - t0 < 10


def test_cache_write_survives_its_block_dir_dropped_by_another_process(tmp_path, monkeypatch):
    """A rank that promotes a shard to a whole file drops the shard's block dir; a rank writing a block
    there at that moment writes it again (it once reported this as a full disk)."""
    cache = ShardCache(tmp_path, "ns", 1 << 30)
    target = cache.block_path("shard_00000", 0)
    real_write, raced = Path.write_bytes, []

    def write_after_the_drop(self, data):
        if not raced:
            raced.append(self)
            cache.drop_blocks("shard_00000")  # between put's mkdir and its write
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_after_the_drop)
    cache.put(target, b"block")
    assert raced and target.read_bytes() == b"block"
