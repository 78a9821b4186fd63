"""Untrusted files: a crafted pickle in a checkpoint is refused before anything unpickles it
(resume and export), our own files load with weights_only=True, recipes are parsed and never
executed, and no loader enables trust_remote_code."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO

from checkpoint import load_for_eval
from checkpoint import tags as ckpt
from checkpoint.pickle_scan import UnsafeCheckpoint, safe_torch_load, scan_pickle
from pretrain.config import load_recipe
from pretrain.train import train

RECIPE = "recipes/tiny_cpu.yaml"
OVER = ["train.eval_every_steps=0", "logging.tensorboard=false", "train.max_steps=2"]


class Payload:
    """Unpickling this runs code: it creates the marker file."""
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    train(RECIPE, OVER, run_dir=d, resume="never")
    return d


@pytest.mark.parametrize("victim", ["rng/rank0.pt", "mp_rank_00_model_states.pt",
                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_crafted_pickle_in_checkpoint_is_refused_and_never_runs(run, tmp_path, victim):
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    tag = ckpt.latest_checkpoint(bad)
    marker = tmp_path / "marker"
    torch.save({"state": Payload(marker)}, tag / victim)
    assert "builtins.exec" in scan_pickle(tag / victim)
    with pytest.raises(UnsafeCheckpoint, match=re.escape(victim.split("/")[-1]) + r".*builtins.exec.*refused"):
        train(RECIPE, OVER + ["train.max_steps=3"], run_dir=bad, resume="auto")
    with pytest.raises(UnsafeCheckpoint):
        load_for_eval(tag) if victim != "zero_pp_rank_0_mp_rank_00_optim_states.pt" else safe_torch_load(tag / victim)
    assert not marker.exists()


def test_own_checkpoint_files_load_weights_only(run):
    tag = ckpt.latest_checkpoint(run)
    for f in sorted(tag.rglob("*.pt")):
        assert scan_pickle(f) == [], f
        safe_torch_load(f)                              # torch.load(..., weights_only=True)
    model, meta = load_for_eval(tag)
    assert meta["step"] == 2


def test_recipe_yaml_is_parsed_never_executed(tmp_path):
    marker = tmp_path / "marker"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(Exception, match="could not determine a constructor|python/object"):
        load_recipe(recipe)
    assert not marker.exists()


def test_no_trust_remote_code_anywhere():
    hits = []
    for pkg in ("model", "pretrain", "data_pipeline", "eval"):
        for f in (REPO / pkg).rglob("*.py"):
            text = f.read_text()
            if re.search(r"trust_remote_code\s*=\s*True", text) or re.search(r"\byaml\.load\(|\bpickle\.loads?\(", text):
                hits.append(str(f.relative_to(REPO)))
            if re.search(r"torch\.load\([^)]*weights_only\s*=\s*False", text):
                hits.append(str(f.relative_to(REPO)))
    assert hits == []
