"""A tiktoken BPE file (the format Llama 3 ships) as a tokenizer, its ranks from tiktoken's own trainer:
it round-trips text, prepares shards whose manifest names it, trains, and eval finds it from the run
alone (no --tokenizer) to report bits per byte."""

from __future__ import annotations

import base64
import json

import pytest
from fixtures import corpus_lines, write_text
from tiktoken._educational import bpe_train

from common.errors import DataError
from data_pipeline.prepare import prepare
from data_pipeline.shards import read_manifest
from data_pipeline.tokenizer import TIKTOKEN_PATTERN, load_tokenizer
from eval.run import main as eval_main
from pretrain.train import train


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiktoken")
    text = "\n".join(corpus_lines(400, "valid"))
    write_text(root / "train.txt", corpus_lines(400, "valid"))
    write_text(root / "valid.txt", corpus_lines(60, "test"))
    ranks = bpe_train(text[:20_000], vocab_size=300, pat_str=TIKTOKEN_PATTERN)
    # the file format: one "<base64 token> <rank>" line per token (tiktoken.load.dump_tiktoken_bpe's)
    lines = sorted(ranks.items(), key=lambda kv: kv[1])
    (root / "tok.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in lines))
    return root


def test_tiktoken_file_tokenizes_prepares_trains_and_evaluates(bpe, tmp_path):
    tok = load_tokenizer(bpe / "tok.tiktoken")
    assert tok.kind == "tiktoken" and tok.vocab_size == 301 and tok.eos_id == 300
    line = "the lobster and the ocean, 12345 tokens!"
    assert tok.decode(tok.encode(line)) == line and max(tok.encode(line)) < 300
    prepare([str(bpe / "train.txt")], bpe / "tok.tiktoken", bpe / "train", progress=False)
    prepare([str(bpe / "valid.txt")], bpe / "tok.tiktoken", bpe / "valid", progress=False)
    manifest = read_manifest(bpe / "train")
    assert manifest["tokenizer_id"] == tok.identity and manifest["tokenizer_id"].startswith("tiktoken:")
    assert manifest["vocab_size"] == 301 and manifest["eos_id"] == 300
    run = tmp_path / "run"
    over = [
        f"data.source={bpe / 'train'}",
        "train.max_steps=2",
        "checkpoint.every_steps=0",
        "logging.tensorboard=false",
    ]
    train("recipes/tiny_cpu.yaml", over, run_dir=run, resume="never")
    out = tmp_path / "ppl.json"
    args = ["--checkpoint", str(run), "--tasks", "perplexity", "--val-dir", str(bpe / "valid"), "--out", str(out)]
    assert eval_main([*args, "--no-progress"]) == 0
    res = json.loads(out.read_text())["tasks"]["perplexity"]
    assert res["bits_per_byte"] > 0 and res["tokens"] > 0


def test_a_file_that_is_not_a_bpe_is_one_error(tmp_path):
    (tmp_path / "bad.tiktoken").write_text("this is not base64 ranks\n")
    with pytest.raises(DataError, match="not a tiktoken BPE file"):
        load_tokenizer(tmp_path / "bad.tiktoken")
