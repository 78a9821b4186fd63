"""lm-eval's own command line on our exports: `python -m eval.lm_eval_cli` (lm-eval's CLI with our class and
tasks registered) on a MixiT export, and plain `lm_eval --include_path eval/tasks` on a Llama export, both run
from a directory that is not the repository's (the bundled tasks find their data beside their YAML)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from fixtures import make_tokenizer

from data_pipeline.tokenizer import load_tokenizer
from eval.lm_eval_adapter import TrainablePartsLM
from eval.lm_eval_cli import hf_export_args, main
from model import preset
from model.io import save_native
from model.transformer import build_model
from pretrain.export import export

TASKS = ("tp_kv_recall", "tp_passkey", "tp_text")
OFFLINE = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok")))


def hf_export(root, variant, tok=None, max_seq_len=64):
    """A tiny model through pretrain.export, with the run's SentencePiece tokenizer beside it when given."""
    vocab = tok.vocab_size if tok else 101
    model = build_model(preset("tiny", variant=variant, vocab_size=vocab, max_seq_len=max_seq_len), seed=0)
    meta = {"tokenizer_id": tok.identity, "tokenizer_path": tok.path} if tok else {}
    save_native(model, root / "native", meta)
    return export(root / "native", root / "hf", "hf")


def lm_eval(args, cwd, **env):
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=dict(os.environ, **OFFLINE, **env), capture_output=True, text=True
    )


def results(out_dir):
    (path,) = out_dir.rglob("results_*.json")
    return json.loads(path.read_text())["results"]


@pytest.mark.slow
def test_lm_eval_cli_scores_a_mixit_export_from_any_directory(tmp_path, tok):
    export_dir = hf_export(tmp_path, "mixit", tok)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["eval.lm_eval_cli", "--model", "hf", "--model_args", f"pretrained={export_dir},dtype=float32"]
    args += ["--tasks", ",".join(TASKS), "--limit", "2", "--batch_size", "2", "--device", "cpu"]
    done = lm_eval([*args, "--output_path", str(tmp_path / "out")], elsewhere, PYTHONPATH=str(REPO))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    res = results(tmp_path / "out")
    assert 0 <= res["tp_kv_recall"]["acc,none"] <= 1 and 0 <= res["tp_passkey"]["exact_match,none"] <= 1
    assert res["tp_text"]["bits_per_byte,none"] > 0
    assert "'backend': 'causal'" in done.stdout + done.stderr  # our class, said to lm-eval to be causal
    assert "fatal: not a git repository" not in done.stderr  # lm-eval's git probe, outside a checkout


@pytest.mark.slow
def test_plain_lm_eval_runs_the_bundled_tasks_from_any_directory(tmp_path, tok):
    """No project module on the path: the task YAML's data loader (eval/tasks/tp_data.py) stands alone."""
    export_dir = hf_export(tmp_path, "standard", tok)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["lm_eval", "--model", "hf", "--model_args", f"pretrained={export_dir},dtype=float32", "--device", "cpu"]
    args += ["--include_path", str(REPO / "eval" / "tasks"), "--tasks", "tp_text", "--limit", "1"]
    done = lm_eval([*args, "--output_path", str(tmp_path / "out")], elsewhere)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert results(tmp_path / "out")["tp_text"]["bits_per_byte,none"] > 0


def test_an_export_without_a_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    export_dir = hf_export(tmp_path, "mixit")
    capsys.readouterr()  # the export's own output
    assert main(["--model", "hf", "--model_args", f"pretrained={export_dir}", "--tasks", "tp_text"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {export_dir} has no tokenizer") and "Fix: add tokenizer=DIR" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("form", ["commas", "words", "equals"])
def test_our_class_is_given_to_lm_eval_as_causal(tmp_path, tok, form):
    export_dir = hf_export(tmp_path, "mixit", tok)
    given = {
        "commas": ["--model_args", f"pretrained={export_dir},dtype=float32"],
        "words": ["--model_args", f"pretrained={export_dir}", "dtype=float32"],
        "equals": [f"--model_args=pretrained={export_dir},dtype=float32"],
    }[form]
    args = hf_export_args(["--model", "hf", *given, "--tasks", "tp_text"])
    assert args == ["--model", "hf", "--model_args", f"pretrained={export_dir},dtype=float32,backend=causal"] + [
        "--tasks",
        "tp_text",
    ]


def test_trainable_parts_model_takes_the_cli_default_device_on_a_cpu_machine(tmp_path, tok):
    """lm-eval's CLI asks every model for cuda:0 unless told otherwise."""
    lm = TrainablePartsLM(checkpoint=str(hf_export(tmp_path, "mixit", tok)), device="cuda:0")
    assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert lm.tokenizer.identity == tok.identity  # the run's own, from the export's trainer_meta.json
