"""The tokenizer of an HF export: what export says when it writes none, and the SentencePiece conversion
giving SentencePiece's ids and text back (lines that start with a space included); and export's output is
its own lines only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from fixtures import make_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import model.hf  # noqa: F401  (registers TrainablePartsForCausalLM, as a user's script does)
from data_pipeline.tokenizer import load_tokenizer
from model import preset
from model.io import save_native
from model.transformer import build_model
from pretrain.export import export
from pretrain.export import main as export_main
from pretrain.train import train

TEXTS = [
    "",
    " leading space",
    "  two leading spaces",
    " ",
    "the river\n the mill\n\n  and the bridge \n",  # lines that start with spaces, inside one document
    "a  b   c\t d",
    "\tthe\n",
    "x </s> y <s> <unk> <pad>",  # special pieces' text is text, as in SentencePiece
    "12 boats, 3.5 é 中",
]


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok")))


def native(tmp_path, meta, vocab_size=101):
    model = build_model(preset("tiny", variant="mixit", vocab_size=vocab_size, max_seq_len=32), seed=0)
    return save_native(model, tmp_path / "native", meta)


def test_sentencepiece_export_round_trips_text_as_sentencepiece_does(tmp_path, sp_tok):
    sp_tok.hf_tokenizer().save_pretrained(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        ids = sp_tok.encode(text)
        assert hf(text)["input_ids"] == ids, text  # no BOS/EOS added, the same pieces
        assert hf.decode(ids) == sp_tok.decode(ids) == text, text
    # the one text that does not come back is SentencePiece's own: its space mark reads as a space
    assert hf.decode(hf("a\u2581b")["input_ids"]) == sp_tok.decode(sp_tok.encode("a\u2581b")) == "a b"


def test_export_says_the_checkpoint_records_no_tokenizer_and_how_to_ship_one(tmp_path, sp_tok, capsys):
    ck = native(tmp_path, {}, vocab_size=sp_tok.vocab_size)
    export(ck, tmp_path / "hf", "hf")
    assert capsys.readouterr().out.splitlines()[-1] == (
        "no tokenizer exported: the checkpoint records no tokenizer. To ship one, export again with "
        "--tokenizer DIR (the tokenizer the model was trained with)"
    )
    args = ["--checkpoint", str(ck), "--out", str(tmp_path / "hf2"), "--format", "hf", "--tokenizer", sp_tok.path]
    assert export_main(args) == 0
    assert "wrote the run's tokenizer (sentencepiece, sp:" in capsys.readouterr().out
    assert AutoTokenizer.from_pretrained(tmp_path / "hf2")(" the")["input_ids"] == sp_tok.encode(" the")


@pytest.mark.parametrize(
    "tokenizer_id, said",
    [
        ("bytes", "the run's tokenizer, bytes, has no transformers form"),
        (
            "sp:0123456789abcdef",
            "the run's tokenizer sp:0123456789abcdef was not found where its recipe points (data.tokenizer or the "
            "shards' manifest). To ship it, export again with --tokenizer DIR (that tokenizer)",
        ),
    ],
)
def test_export_names_the_tokenizer_it_could_not_write(tmp_path, capsys, tokenizer_id, said):
    export(native(tmp_path, {"tokenizer_id": tokenizer_id}, vocab_size=256), tmp_path / "hf", "hf")
    assert capsys.readouterr().out.splitlines()[-1] == f"no tokenizer exported: {said}"


def test_export_refuses_a_tokenizer_for_native_weights_in_one_line(tmp_path, sp_tok, capsys):
    ck = native(tmp_path, {})
    assert export_main(["--checkpoint", str(ck), "--out", str(tmp_path / "o"), "--tokenizer", sp_tok.path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tokenizer is written beside HuggingFace weights only. Fix: add --format hf")
    assert "Traceback" not in err


def test_tiny_cpu_mixit_run_exports_says_why_no_tokenizer_and_generates(tmp_path, capsys):
    """The recipe a new user starts with (here MixiT, on its synthetic task), end to end in plain transformers."""
    run = tmp_path / "run"
    over = ["model.variant=mixit", "train.max_steps=2", "checkpoint.every_steps=0", "train.eval_every_steps=0"]
    over += ["logging.tensorboard=false"]
    train("recipes/tiny_cpu.yaml", over, run_dir=run)
    assert export_main(["--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert (
        "no tokenizer exported: the run has no tokenizer (it trained on the token ids of a synthetic task, "
        "synthetic:kv_retrieval:v1, not on text). To ship one, train on text prepared with a tokenizer "
        "(python -m data_pipeline.prepare) and export that run\n" in out
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "TrainablePartsForCausalLM"
    assert hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape == (1, 7)


def test_export_prints_its_own_lines_only(tmp_path):
    """No DeepSpeed accelerator warning (DS_ACCELERATOR unset, no GPU) and no progress bar, which a new user
    met on every export: what was written, and why no tokenizer was."""
    model = build_model(preset("tiny", variant="mixit", vocab_size=64, max_seq_len=32), seed=0)
    save_native(model, tmp_path / "native", {"step": 1})
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    cmd = [sys.executable, "-m", "pretrain.export", "--checkpoint", str(tmp_path / "native"), "--format", "hf"]
    out = subprocess.run(
        [*cmd, "--out", str(tmp_path / "hf")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("no tokenizer exported: the checkpoint records no tokenizer"), lines
    assert lines[1] == f"wrote hf checkpoint to {tmp_path / 'hf'}"
