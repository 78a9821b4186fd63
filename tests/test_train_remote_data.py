"""Two real training ranks (gloo) reading their shards from loopback HTTP and S3 servers give
exactly the losses of the same run on local shards, also across a kill -9 and --resume auto;
an HTTP server outage mid-run stops both ranks with an error naming the URL and loses nothing."""

from __future__ import annotations

import pytest
from conftest import read_losses, run_ranks, start_ranks, wait_for_steps
from fixtures import (
    corpus_lines,
    http_server,
    make_tokenizer,
    s3_server,
    s3_storage_options,
    upload_dir,
    write_text,
)

from checkpoint import tag_format as ckpt
from data_pipeline import loader as loader_mod
from data_pipeline import shards as shard_mod
from data_pipeline.prepare import prepare
from pretrain.train import train

pytestmark = pytest.mark.slow

RECIPE = "recipes/tiny_cpu.yaml"
COMMON = [
    "model.variant=standard",
    "train.max_steps=12",
    "train.eval_every_steps=0",
    "logging.tensorboard=false",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=0",
    "data.val_fraction=0.05",
    "data.cache_block_kb=1",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_remote")
    tok = make_tokenizer(root / "tok")
    write_text(root / "c.txt", corpus_lines(600, "valid"))
    prepare([str(root / "c.txt")], tok, root / "srv" / "corpus", shard_tokens=6_000, progress=False)
    http = http_server(root / "srv")
    s3 = s3_server()
    opts = s3_storage_options(s3)
    upload_dir(root / "srv" / "corpus", "s3://train/corpus", opts)
    yield {"root": root, "local": root / "srv" / "corpus", "http": http, "s3": s3, "s3_opts": opts}
    http.stop()
    s3.stop()


def data_args(shards, backend, cache) -> list[str]:
    if backend == "local":
        return [f"data.source={shards['local']}"]
    args = [f"data.cache_dir={cache}"]
    if backend == "http":
        return args + [f"data.source={shards['http'].url}/corpus"]
    o = shards["s3_opts"]
    return args + [
        "data.source=s3://train/corpus",
        f"data.storage_options.endpoint_url={o['endpoint_url']}",
        f"data.storage_options.key={o['key']}",
        f"data.storage_options.secret={o['secret']}",
    ]


@pytest.fixture(scope="module")
def local_losses(shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("local_run")
    run_ranks(["--recipe", RECIPE, "--run-dir", str(run), *COMMON, *data_args(shards, "local", None)])
    losses = read_losses(run)
    assert sorted(losses) == list(range(1, 13))
    return losses


@pytest.mark.parametrize("backend", ["http", "s3"])
def test_two_ranks_on_remote_shards_match_local_across_kill9(shards, local_losses, backend, tmp_path):
    run = tmp_path / "run"
    if backend == "http":  # a server of its own, to take away mid-run below
        srv = http_server(shards["root"] / "srv")
        data = [
            f"data.source={srv.url}/corpus",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.retries=2",
            "data.retry_backoff_s=0.2",
            "data.cache_max_gb=0.0",
        ]  # no block stays on disk
    else:
        srv, data = None, data_args(shards, backend, tmp_path / "cache")
    args = ["--recipe", RECIPE, "--run-dir", str(run), *COMMON, *data]
    procs = start_ranks(args)
    try:
        wait_for_steps(run, 6, procs)
        for p in procs:
            p.kill()  # kill -9 both ranks after the step-4 checkpoint
            p.wait()
        assert ckpt.latest_checkpoint(run).name == ckpt.tag_for(4)
        if srv is not None:
            # resumed, and then the server goes away: retries, then one line naming the URL, and
            # the checkpoint stays the one to resume from
            metrics = run / "metrics.jsonl"
            metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:4]))  # as resume does
            procs = start_ranks([*args, "--resume", "auto"])
            wait_for_steps(run, 5, procs)  # step 5 of the resumed run: steps 9-12 need the server
            srv.stop()
            outs = [p.communicate(timeout=120)[0] for p in procs]
            assert all(p.returncode != 0 for p in procs), outs
            assert any(f"error: cannot read {srv.url}/corpus/shard_" in o and "after 3 attempts" in o for o in outs), (
                outs
            )
            assert not any("Traceback" in o for o in outs), outs
            assert ckpt.latest_checkpoint(run) is not None  # complete checkpoints only; the last one resumes
            srv.start()
        out = run_ranks([*args, "--resume", "auto"])
        assert "resumed from" in out
        assert read_losses(run) == local_losses  # exactly, not approximately
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if srv is not None:
            srv.stop()


def test_the_trainer_hashes_shards_once_per_run(shards, tmp_path, monkeypatch):
    """The first start of a run sha256-checks the shards and records it in the run dir; a resume
    (any rank, any later start) finds the record and checks sizes only."""
    hashed = []
    real = shard_mod._verify_contents
    monkeypatch.setattr(shard_mod, "_verify_contents", lambda d, m: (hashed.append(d), real(d, m))[1])
    run = tmp_path / "run"
    over = [*COMMON, *data_args(shards, "local", None), "data.verify=full", "train.max_steps=2"]
    train(RECIPE, over, run_dir=run, resume="never")
    assert len(hashed) == 1 and (run / shard_mod.VERIFY_RECORD).is_file()
    loader_mod._VERIFIED.clear()  # as a new process would start: only the record remains
    train(RECIPE, [*over[:-1], "train.max_steps=4"], run_dir=run, resume="auto")
    assert len(hashed) == 1  # the resume found the record: nothing hashed again
