"""Bad input is refused with the problem and the fix, before a model or engine is built:
malformed recipe YAML (file and line), wrong types, a run name that leaves runs/, a run dir holding another run, a checkpoint of another
variant or tokenizer, a sequence length beyond the model, an empty dataset. (Unknown keys,
impossible layouts, corrupt shards and tokenizer/data mismatches are covered elsewhere; see
docs/RELIABILITY.md.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

from checkpoint import tag_format as ckpt
from common.errors import RecipeError
from pretrain.config import load_recipe
from pretrain.engine import ModelEngine
from pretrain.train import train

RECIPE = "recipes/tiny_cpu.yaml"
FAST = ["train.eval_every_steps=0", "logging.tensorboard=false"]
BASE = FAST + ["train.max_steps=2", "model.vocab_size=512"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained")
    train(RECIPE, BASE, run_dir=run, resume="never")
    return run


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if a refusal comes only after the engine was built (expensive work)."""

    def boom(*a, **k):
        raise AssertionError("the engine was built before the error")

    monkeypatch.setattr(ModelEngine, "build", boom)


@pytest.mark.parametrize(
    "override, msg",
    [
        ("train.max_steps=ten", r"train.max_steps='ten' has type str; expected int"),
        ("optim.lr=[0.1]", r"optim.lr=\[0.1\] has type list; expected float"),
        ("checkpoint.save_final=1", r"checkpoint.save_final=1 has type int; expected bool"),
        ("train.nan_policy=ignore", r"nan_policy must be one of \['skip', 'stop', 'rollback'\]"),
        ("parallel.timeout_s=0", r"timeout_s > 0"),
        ("parallel.pipeline_stages=2 data.return_doc_ids=true", r"return_doc_ids.*Fix: set parallel.pipeline_stages=1"),
    ],
)
def test_wrong_types_and_values_name_the_key(override, msg):
    with pytest.raises(RecipeError, match=msg):
        load_recipe(RECIPE, override.split())


@pytest.mark.parametrize(
    "text, line, problem",
    [
        ("name: x\ntrain:\n  seq_len: 32\n   max_steps: 3\n", 4, "mapping values are not allowed here"),
        ("name: x\noptim:\n  betas: [0.9, 0.95\n", 4, r"flow sequence from line 3; expected ',' or '\]'"),
        ("name: 'x\nseed: 1\n", 3, "quoted scalar from line 1"),
        ("name: x\n\tseed: 1\n", 2, r"found character '\\t' that cannot start any token"),
    ],
)
def test_malformed_recipe_yaml_names_the_file_and_line(tmp_path, text, line, problem):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    with pytest.raises(
        RecipeError,
        match=rf"^{re.escape(str(recipe))}:{line}:\d+: not valid recipe YAML \(.*{problem}"
        r".*\)\. Fix: ",
    ):
        load_recipe(recipe)


def test_malformed_recipe_yaml_is_one_error_line_and_exit_2(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: x\ntrain:\n  seq_len: 32\n   max_steps: 3\n")
    out = subprocess.run(
        [sys.executable, "-m", "pretrain.train", "--recipe", str(recipe)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert errors == [x for x in out.stderr.splitlines() if x.startswith(("error:", "Traceback"))]
    assert len(errors) == 1 and re.match(rf"error: {re.escape(str(recipe))}:4:\d+: .*Fix: ", errors[0])


@pytest.mark.parametrize("name", ["../../etc", "/tmp/x", "a/b", ".."])
def test_run_name_cannot_leave_runs_dir(name):
    with pytest.raises(RecipeError, match="single directory name"):
        load_recipe(RECIPE, [f"name={name}"])


def test_run_dir_with_another_run_is_refused_unless_resumed_or_overwritten(trained, no_engine):
    with pytest.raises(RecipeError, match="already holds a run.*--resume auto.*--overwrite"):
        train(RECIPE, BASE, run_dir=trained, resume="never")
    with pytest.raises(RecipeError, match=r"holds a different run \(.*seed: there 1234, here 7"):
        train(RECIPE, BASE + ["seed=7"], run_dir=trained, resume="auto")


def test_overwrite_replaces_the_old_run(tmp_path):
    train(RECIPE, BASE, run_dir=tmp_path, resume="never")
    res = train(RECIPE, BASE + ["seed=7", "train.max_steps=1"], run_dir=tmp_path, resume="never", overwrite=True)
    assert res.resumed_from is None and [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]


def test_checkpoint_of_another_variant_or_shape_is_refused(trained, tmp_path, no_engine):
    with pytest.raises(RecipeError, match="variant: config has 'mixit', checkpoint has 'standard'.*Fix"):
        train(RECIPE, BASE + ["model.variant=mixit"], run_dir=tmp_path, resume=str(trained))
    with pytest.raises(RecipeError, match="hidden_size: config has 96"):
        train(RECIPE, BASE + ["model.hidden_size=96"], run_dir=tmp_path, resume=str(trained))


def test_checkpoint_of_another_tokenizer_is_refused(trained, tmp_path, no_engine):
    text = tmp_path / "t.txt"
    text.write_text("some bytes to train on " * 200)
    with pytest.raises(RecipeError, match="trained on tokenizer .* uses bytes.*Fix"):
        train(RECIPE, BASE + [f"data.source=text:{text}"], run_dir=tmp_path / "r", resume=str(trained))


def test_sequence_length_beyond_the_model_is_refused(tmp_path, no_engine):
    with pytest.raises(RecipeError, match="model.max_seq_len=16 < train.seq_len=32"):
        train(RECIPE, BASE + ["model.max_seq_len=16"], run_dir=tmp_path, resume="never")


def test_empty_dataset_is_refused_before_the_model(tmp_path, no_engine):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(RecipeError, match="data: .*empty.txt.*shorter than one sequence"):
        train(RECIPE, BASE + [f"data.source=text:{tmp_path / 'empty.txt'}"], run_dir=tmp_path / "r", resume="never")
    assert not (tmp_path / "r").exists()  # a refused run leaves no run dir behind (it left a .rendezvous mark)


def test_a_refused_run_leaves_an_existing_run_dir_as_it_was(tmp_path, no_engine):
    run = tmp_path / "r"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="model.max_seq_len=16 < train.seq_len=32"):
        train(RECIPE, BASE + ["model.max_seq_len=16"], run_dir=run, resume="never")
    assert [p.name for p in run.iterdir()] == ["notes.txt"]
