"""Small local fixtures shared by the tests and the data benchmarks (no network beyond loopback, no big files).

Text is generated (deterministic, English-shaped), so the tests run the same anywhere: nothing
outside the repository is read.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from data_pipeline.prepare import prepare
from data_pipeline.tokenizer import train_sentencepiece
from studies.static_server import LoopbackServer, http_server  # noqa: F401  (the tests' servers)

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no what up out "
    "lobster ocean river city music model data train token shard memory order seed epoch"
).split()


def corpus_lines(n_lines: int, split: str = "valid") -> list[str]:
    """``n_lines`` non-empty lines of generated text, the same for the same ``split``."""
    rng = random.Random(split)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 120))) + " ." for _ in range(n_lines)]


SOURCES = {  # three sources with different text, so their losses differ
    "prose": "the of and to in a is that for it as was with be by on not he this are or his from at".split(),
    "code": "def return self import class if else for in range print lambda yield None True False".split(),
    "dict": "noun verb adj adv defn etym syn pl n v a Webster 1913 obs rare see".split(),
}


def write_source_corpus(path: Path, n_docs: int, seed: int) -> None:
    """JSON lines {"id", "source", "text"} cycling through SOURCES, like the docs corpus."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n_docs):
            source = list(SOURCES)[i % 3]
            lines = [" ".join(rng.choice(SOURCES[source]) for _ in range(rng.randint(4, 14))) for _ in range(6)]
            f.write(json.dumps({"id": f"{source}/{i}", "source": source, "text": "\n".join(lines)}) + "\n")


def source_corpus(root: Path) -> tuple[Path, Path, dict[str, str]]:
    """A small corpus of three sources as the scaling study prepares the docs corpus: a tokenizer trained
    on train.jsonl, its shards, and one validation set per source -> (root, tokenizer dir, {source: dir})."""
    write_source_corpus(root / "train.jsonl", 240, seed=1)
    write_source_corpus(root / "valid.jsonl", 30, seed=2)
    tok = root / "tok"
    train_sentencepiece([str(root / "train.jsonl")], 320, tok, quiet=True)
    prepare(root / "train.jsonl", tok, root / "train", progress=False)
    sets = {}
    for source in SOURCES:
        sets[source] = str(root / f"valid-{source}")
        prepare(root / "valid.jsonl", tok, sets[source], progress=False, where=[f"source={source}"])
    return root, tok, sets


def write_text(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_tokenizer(out: Path, vocab_size: int = 400, n_lines: int = 1500) -> Path:
    """Train a small SentencePiece tokenizer on local text (about a second)."""

    src = write_text(Path(out) / "_train.txt", corpus_lines(n_lines))
    train_sentencepiece([str(src)], vocab_size, out, quiet=True)
    return Path(out)


# ---- real servers on loopback, for the remote-shard tests and the loader benchmark ----------
#
# HTTP: aiohttp's web server (a production HTTP server; its static file handler implements
# Range/206/416 itself), run as its own process with `python -m aiohttp.web`. S3: moto's
# server (`python -m moto.server`), a separate process speaking the S3 REST protocol, so
# s3fs/botocore sign, send and parse real HTTP requests against it. Both come from
# pyproject.toml, so a clean checkout has them without system packages.


S3_TEST_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def s3_server(port: int | None = None) -> LoopbackServer:
    """An S3-compatible server (moto) in a separate process; its state lives in that process."""
    return LoopbackServer(
        lambda p: [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(p)], port, env=S3_TEST_ENV
    )


def s3_storage_options(server: LoopbackServer, fast_fail: bool = False) -> dict:
    """fsspec options for ``s3://`` URLs on ``server`` (fast_fail: no retries inside botocore; s3fs's
    own loop is the class attribute ``s3fs.S3FileSystem.retries``)."""
    opts = {
        "endpoint_url": server.url,
        "key": S3_TEST_ENV["AWS_ACCESS_KEY_ID"],
        "secret": S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        "config_kwargs": {"region_name": "us-east-1"},
    }
    if fast_fail:
        opts["config_kwargs"].update(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5)
    return opts


def upload_dir(local: str | Path, url: str, storage_options: dict | None = None) -> None:
    """Copy every file of a prepared directory to ``url`` (e.g. ``s3://bucket/corpus``)."""
    import fsspec  # deferred: heavy backends

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    bucket = root.split("/", 1)[0]
    if url.startswith("s3://"):
        fs.invalidate_cache()  # the server may have been restarted (moto keeps objects in memory)
        try:
            fs.mkdir(bucket)
        except FileExistsError:
            pass
    for p in sorted(Path(local).iterdir()):
        if p.is_file():
            fs.pipe_file(f"{root}/{p.name}", p.read_bytes())


class OpDtypes(TorchDispatchMode):
    """Records (op, output dtype, output numel) of every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.dtype, t.numel()))
        return out
