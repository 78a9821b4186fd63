"""Bad input gives a clear error: no checkpoint at the path, a tokenizer that does not match, an unknown task."""

import pytest
import torch

from common.errors import EvalError
from eval.loading import load_checkpoint
from eval.run import evaluate_checkpoint, main, validate_tasks
from model import preset
from model.io import save_native
from model.transformer import build_model

torch.set_num_threads(1)


def test_missing_and_empty_checkpoint_paths(tmp_path, capsys):
    with pytest.raises(EvalError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalError, match="no checkpoint found"):
        load_checkpoint(tmp_path / "empty")
    assert main(["--checkpoint", str(tmp_path / "empty"), "--tasks", "induction", "--no-progress"]) == 2
    assert "no checkpoint found" in capsys.readouterr().err


def test_tokenizer_mismatch(tmp_path, capsys):
    model = build_model(preset("tiny", vocab_size=300, max_seq_len=64), seed=0)
    save_native(model, tmp_path / "ck", {"step": 1, "tokenizer_id": "sp:0123456789abcdef"})
    (tmp_path / "t.txt").write_text("hello world " * 20)
    with pytest.raises(EvalError, match="tokenizer mismatch"):
        evaluate_checkpoint(
            tmp_path / "ck", ["perplexity"], tokenizer="bytes", text=str(tmp_path / "t.txt"), progress=False
        )
    rc = main(["--checkpoint", str(tmp_path / "ck"), "--tasks", "passkey", "--tokenizer", "bytes", "--no-progress"])
    assert rc == 2 and "tokenizer mismatch" in capsys.readouterr().err
    # a vocabulary that cannot fit the checkpoint is refused even without a recorded identity
    small = build_model(preset("tiny", vocab_size=100, max_seq_len=64), seed=0)
    save_native(small, tmp_path / "small", {"step": 1})
    with pytest.raises(EvalError, match="vocabulary"):
        evaluate_checkpoint(tmp_path / "small", ["passkey"], tokenizer="bytes", progress=False)


def test_unknown_task(tmp_path, capsys):
    with pytest.raises(EvalError, match="did you mean 'perplexity'"):
        validate_tasks("perplexty")
    with pytest.raises(EvalError, match="unknown synthetic task"):
        validate_tasks(["synthetic:nope"])
    assert main(["--checkpoint", str(tmp_path), "--tasks", "induction,bogus", "--no-progress"]) == 2
    assert "unknown task 'bogus'" in capsys.readouterr().err


def test_tasks_needing_inputs(tmp_path):
    model = build_model(preset("tiny", vocab_size=50, max_seq_len=32), seed=0)
    save_native(model, tmp_path / "ck", {"step": 1})
    with pytest.raises(EvalError, match="--text FILE or --val-dir"):
        evaluate_checkpoint(tmp_path / "ck", ["perplexity"], progress=False)
    with pytest.raises(EvalError, match="needs a tokenizer"):
        evaluate_checkpoint(tmp_path / "ck", ["passkey"], progress=False)


def test_the_runs_tokenizer_is_used_when_none_is_given(tmp_path):
    from fixtures import corpus_lines, make_tokenizer, write_text

    from data_pipeline.prepare import prepare
    from data_pipeline.tokenizer import load_tokenizer as load_dir
    from eval.loading import run_tokenizer

    tok = load_dir(make_tokenizer(tmp_path / "tok"))
    prepare(
        [str(write_text(tmp_path / "c.txt", corpus_lines(50)))],
        str(tmp_path / "tok"),
        tmp_path / "shards",
        progress=False,
    )
    text = tmp_path / "t.txt"
    text.write_text("the river and the ocean " * 10)
    model = build_model(preset("tiny", vocab_size=tok.vocab_size, max_seq_len=64), seed=0)
    for name, data in [
        ("shards", {"source": str(tmp_path / "shards")}),  # the shards' manifest names it
        ("named", {"source": "elsewhere", "tokenizer": str(tmp_path / "tok")}),
    ]:  # data.tokenizer
        save_native(model, tmp_path / name, {"step": 1, "tokenizer_id": tok.identity, "data": data})
        res = evaluate_checkpoint(tmp_path / name, ["perplexity"], text=str(text), progress=False)
        assert res["checkpoint"]["tokenizer_used"] == tok.identity
    _, info = load_checkpoint(tmp_path / "shards")
    assert run_tokenizer(info).identity == tok.identity
    assert run_tokenizer({"tokenizer_id": "bytes"}).identity == "bytes"
    save_native(model, tmp_path / "lost", {"step": 1, "tokenizer_id": tok.identity, "data": {"source": "gone"}})
    with pytest.raises(EvalError, match=f"records tokenizer {tok.identity}, which was not found.*Fix: pass --tok"):
        evaluate_checkpoint(tmp_path / "lost", ["perplexity"], text=str(text), progress=False)
