"""A recipe trains the model it names: an explicit vocabulary (the recipe's or the preset's) is
kept over a byte-level `text:` source's 256, or refused when too small; and YAML's unquoted
`off`/`on` (read as booleans) are accepted for logging.progress_bar."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from conftest import REPO

from common.errors import RecipeError
from model import param_count
from pretrain.config import load_recipe
from pretrain.dry_run import dry_run
from pretrain.loaders import loader
from pretrain.task_model import model_config

GPU_RECIPE = "recipes/1b_gpu_zero1.yaml"


@pytest.fixture
def text_source(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
    return f"text:{path}"


def _data_vocab(cfg) -> int:
    return loader(cfg, "train").vocab_size


def test_preset_vocabulary_is_kept_over_a_byte_text_source(text_source):
    # no validation: this text's held-out share is shorter than one of the recipe's sequences, which a run
    # (and its --dry-run) refuses
    cfg = load_recipe(GPU_RECIPE, [f"data.source={text_source}", "train.eval_every_steps=0"])
    data_vocab = _data_vocab(cfg)
    assert data_vocab == 256
    mcfg = model_config(cfg, data_vocab)
    assert mcfg.vocab_size == 128256
    assert param_count(mcfg)["total"] == 1_235_814_400  # the 1b model, not a 256-token one
    out = io.StringIO()
    dry_run(cfg, 8, out=out)
    assert "vocab_size: 128256 (the preset's; the data's vocabulary is 256)" in out.getvalue()


def test_recipe_vocabulary_is_kept_or_refused(text_source):
    kept = load_recipe("recipes/tiny_cpu.yaml", [f"data.source={text_source}", "model.vocab_size=1000"])
    assert model_config(kept, _data_vocab(kept)).vocab_size == 1000
    from_data = load_recipe("recipes/tiny_cpu.yaml", [f"data.source={text_source}"])
    assert model_config(from_data, _data_vocab(from_data)).vocab_size == 256
    null = load_recipe(GPU_RECIPE, [f"data.source={text_source}", "model.vocab_size=null"])
    assert model_config(null, 256).vocab_size == 256  # explicitly asked for the data's
    small = load_recipe("recipes/tiny_cpu.yaml", [f"data.source={text_source}", "model.vocab_size=100"])
    with pytest.raises(RecipeError, match=r"model.vocab_size=100 is smaller than the data's vocabulary 256\. Fix: "):
        model_config(small, _data_vocab(small))


def test_too_small_vocabulary_is_one_error_line_from_the_cli(tmp_path, text_source):
    cmd = [
        sys.executable,
        "-m",
        "pretrain.train",
        "--recipe",
        "recipes/tiny_cpu.yaml",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    out = subprocess.run(
        [*cmd, f"data.source={text_source}", "model.vocab_size=100"],
        cwd=REPO,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = out.stderr.strip().splitlines()
    assert out.returncode != 0
    assert len(err) == 1 and err[0].startswith("error: ") and "Fix:" in err[0], out.stderr[-2000:]


@pytest.mark.parametrize("raw, value", [("off", "off"), ("on", "on"), ("false", "off"), ("true", "on")])
def test_progress_bar_accepts_unquoted_yaml_booleans(tmp_path, raw, value):
    recipe = tmp_path / "r.yaml"
    base = (REPO / "recipes" / "tiny_cpu.yaml").read_text().replace('progress_bar: "off"', f"progress_bar: {raw}")
    assert f"progress_bar: {raw}" in base
    recipe.write_text(base)
    assert load_recipe(str(recipe)).logging.progress_bar == value
    assert load_recipe("recipes/tiny_cpu.yaml", [f"logging.progress_bar={raw}"]).logging.progress_bar == value


def test_progress_bar_still_refuses_other_values():
    with pytest.raises(RecipeError, match="progress_bar"):
        load_recipe("recipes/tiny_cpu.yaml", ["logging.progress_bar=sometimes"])
