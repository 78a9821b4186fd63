"""Every CLI answers bad input with one line: run as a real subprocess on a missing path, a crafted
pickle, a corrupt file, a wrong tokenizer or a bad option value, it exits non-zero and its stderr
holds exactly one line starting with `error:` that says `Fix:` once (a message whose remedy was not
after `Fix:` used to end in a second, generic one), and no traceback."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

from checkpoint import tag_format as ckpt
from model import preset
from model.io import save_native
from model.transformer import build_model
from pretrain.train import train

ENV = dict(
    os.environ,
    DS_ACCELERATOR="cpu",
    PYTHONPATH=str(REPO),
    OMP_NUM_THREADS="1",
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
)


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """A trained run, a copy holding a crafted pickle, one with a truncated file, and a native
    checkpoint that records a tokenizer other than bytes."""
    d = tmp_path_factory.mktemp("cli")
    train(
        "recipes/tiny_cpu.yaml",
        ["train.eval_every_steps=0", "logging.tensorboard=false", "train.max_steps=2"],
        run_dir=d / "run",
        resume="never",
    )
    shutil.copytree(d / "run", d / "crafted")
    crafted = ckpt.latest_checkpoint(d / "crafted")
    torch.save({"state": Payload(d / "marker")}, crafted / "mp_rank_00_model_states.pt")
    ckpt.mark_complete(crafted)  # whoever can plant a file can rewrite the file list too: the scan is the guard
    model = build_model(preset("tiny", vocab_size=300, max_seq_len=32), seed=0)
    save_native(model, d / "sp_model", {"step": 1, "tokenizer_id": "sp:0123456789abcdef"})
    shutil.copytree(d / "sp_model", d / "corrupt")
    w = d / "corrupt" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    (d / "text.txt").write_text("some text to read " * 20)
    return d


def check_one_error_line(args: list[str], expect: str, cwd: Path = REPO) -> None:
    p = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(errors) == 1 and errors[0].count("Fix:") == 1, p.stderr[-3000:]
    assert expect in errors[0], errors[0]


@pytest.mark.parametrize(
    "case",
    [
        "export-crafted",
        "export-missing",
        "export-corrupt",
        "universal-crafted",
        "train-bad-value",
        "train-bad-option",
        "train-missing-data",
    ],
)
def test_pretrain_clis(ck, tmp_path, case):
    args, expect = {
        "export-crafted": (
            ["pretrain.export", "--checkpoint", str(ck / "crafted"), "--out", str(tmp_path / "o")],
            "builtins.exec",
        ),
        "export-missing": (
            ["pretrain.export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
            "does not exist",
        ),
        "export-corrupt": (
            ["pretrain.export", "--checkpoint", str(ck / "corrupt"), "--out", str(tmp_path / "o")],
            "corrupt or truncated",
        ),
        "universal-crafted": (
            ["pretrain.universal", "--checkpoint", str(ck / "crafted"), "--out", str(tmp_path / "u")],
            "builtins.exec",
        ),
        "train-bad-value": (
            ["pretrain.train", "--recipe", "recipes/tiny_cpu.yaml", "--dry-run", "train.max_steps=many"],
            "train.max_steps",
        ),
        "train-bad-option": (["pretrain.train", "--recipe", "recipes/tiny_cpu.yaml", "--dry-rn"], "--dry-rn"),
        "train-missing-data": (
            ["pretrain.train", "--recipe", "recipes/tiny_cpu.yaml", f"data.source={tmp_path / 'shards'}"],
            "does not exist. Fix: create it with 'python -m data_pipeline.prepare",
        ),
    }[case]
    check_one_error_line(args, expect)
    assert not (ck / "marker").exists()  # the crafted pickle never ran


@pytest.mark.parametrize(
    "case",
    [
        "run-wrong-tokenizer",
        "run-crafted",
        "run-corrupt",
        "run-bad-option",
        "generate-missing",
        "generate-bad-temperature",
    ],
)
def test_eval_clis(ck, case):
    args, expect = {
        "run-wrong-tokenizer": (
            [
                "eval.run",
                "--checkpoint",
                str(ck / "sp_model"),
                "--tasks",
                "perplexity",
                "--text",
                str(ck / "text.txt"),
                "--tokenizer",
                "bytes",
            ],
            "tokenizer mismatch",
        ),
        "run-crafted": (["eval.run", "--checkpoint", str(ck / "crafted"), "--tasks", "induction"], "builtins.exec"),
        "run-corrupt": (["eval.run", "--checkpoint", str(ck / "corrupt"), "--tasks", "induction"], "corrupt"),
        "run-bad-option": (
            ["eval.run", "--checkpoint", str(ck / "run"), "--tasks", "induction", "--task-args", "{"],
            "--task-args",
        ),
        "generate-missing": (["eval.generate", "--checkpoint", str(ck / "nope"), "--prompt", "a"], "does not exist"),
        "generate-bad-temperature": (
            ["eval.generate", "--checkpoint", str(ck / "run"), "--temperature", "-1"],
            "temperature",
        ),
    }[case]
    check_one_error_line(args, expect)
    assert not (ck / "marker").exists()


@pytest.mark.parametrize("case", ["demo-variant", "demo-scale", "scaling-recipe", "scaling-collect", "capacity-widths"])
def test_studies_clis(tmp_path, case):
    args, expect = {
        "demo-variant": (["studies.demo", "--out", str(tmp_path), "--variants", "standrd"], "standrd"),
        "demo-scale": (["studies.demo", "--out", str(tmp_path), "--steps-scale", "-1"], "--steps-scale"),
        "scaling-recipe": (
            ["studies.scaling", "sweep", "--recipe", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)],
            "nope.yaml",
        ),
        "scaling-collect": (["studies.scaling", "collect", "--out", str(tmp_path)], "no runs"),
        "capacity-widths": (["studies.capacity", "--widths", "16,x"], "--widths"),
    }[case]
    check_one_error_line(args, expect)


@pytest.mark.parametrize(
    "case", ["prepare-missing", "prepare-tokenizer", "tokenizer-info", "tokenizer-vocab", "classification-n"]
)
def test_data_pipeline_clis(tmp_path, case):
    (tmp_path / "a.txt").write_text("hello\n")
    args, expect = {
        "prepare-missing": (
            [
                "data_pipeline.prepare",
                "--source",
                str(tmp_path / "nope.txt"),
                "--tokenizer",
                "bytes",
                "--out",
                str(tmp_path / "s"),
            ],
            "nope.txt",
        ),
        "prepare-tokenizer": (
            [
                "data_pipeline.prepare",
                "--source",
                str(tmp_path / "a.txt"),
                "--tokenizer",
                str(tmp_path / "tok"),
                "--out",
                str(tmp_path / "s"),
            ],
            "tok does not exist",
        ),
        "tokenizer-info": (["data_pipeline.tokenizer", "info", str(tmp_path / "tok")], "does not exist"),
        "tokenizer-vocab": (
            [
                "data_pipeline.tokenizer",
                "train",
                "--input",
                str(tmp_path / "a.txt"),
                "--vocab-size",
                "lots",
                "--out",
                str(tmp_path / "t"),
            ],
            "--vocab-size",
        ),
        "classification-n": (["data_pipeline.classification", "--out", str(tmp_path / "c.jsonl"), "--n", "0"], "--n"),
    }[case]
    check_one_error_line(args, expect)


REMEDY = re.compile(
    r"; (or )?(use|re-run|check|pass|create|delete|set|raise|choose|remove|retrain|convert|enlarge|prepare|export|"
    r"add|shorten|resume|fill|restore|install|make|give|write|train|upload)\b"
)
RAISED = {"UserError", "ConfigError", "DataError", "RecipeError", "CorruptCheckpoint", "UnsafeCheckpoint", "EvalError"}
RAISED |= {"PreflightError", "StudyError", "FileNotFoundError", "OSError", "RunStopped", "CheckpointWriteFailed"}


def _literal(node: ast.expr) -> str:
    """A message's text, each interpolated value as {}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) + _literal(node.right)
    return "{}"


def test_an_error_that_names_its_remedy_names_it_after_fix():
    """print_error adds a generic `Fix:` to a message without one, so a remedy written after a semicolon
    ("...; use an earlier checkpoint") ended in two. Every error the CLIs print says its remedy after `Fix:`."""
    found = []
    for pkg in ("common", "model", "data_pipeline", "checkpoint", "pretrain", "eval", "studies"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                    continue
                name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
                text = _literal(node.exc.args[0])
                if name in RAISED and "Fix:" not in text and REMEDY.search(text):
                    found.append(f"{f.relative_to(REPO)}:{node.lineno}: {text[:100]}")
    assert found == []
