"""Untrusted files: a crafted pickle in a checkpoint is refused before anything unpickles it
(resume, export, universal conversion), what is loaded is what was scanned (DeepSpeed's loaders
included, weights-only), `latest` cannot lead out of the checkpoints directory, our own files
load with weights_only=True, recipes are parsed and never executed, and no loader enables
trust_remote_code."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

from checkpoint import load_for_eval, pickle_scan
from checkpoint import tag_format as ckpt
from checkpoint.pickle_scan import safe_torch_load, scan_pickle
from common.errors import RecipeError, UnsafeCheckpoint
from pretrain import universal
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


@pytest.mark.parametrize(
    "victim", ["rng/rank0.pt", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
)
def test_crafted_pickle_in_checkpoint_is_refused_and_never_runs(run, tmp_path, victim):
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    tag = ckpt.latest_checkpoint(bad)
    marker = tmp_path / "marker"
    torch.save({"state": Payload(marker)}, tag / victim)
    ckpt.mark_complete(tag)  # whoever can plant a file can rewrite the file list too: the scan is the guard
    assert "builtins.exec" in scan_pickle(tag / victim)
    with pytest.raises(UnsafeCheckpoint, match=re.escape(victim.split("/")[-1]) + r".*builtins.exec.*refused"):
        train(RECIPE, OVER + ["train.max_steps=3"], run_dir=bad, resume="auto")
    with pytest.raises(UnsafeCheckpoint):
        load_for_eval(tag) if victim != "zero_pp_rank_0_mp_rank_00_optim_states.pt" else safe_torch_load(tag / victim)
    assert not marker.exists()


def test_latest_naming_a_path_outside_the_checkpoints_dir_is_refused_not_followed(run, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    elsewhere = tmp_path / "elsewhere"  # a complete-looking checkpoint outside the run
    shutil.copytree(ckpt.latest_checkpoint(bad), elsewhere)
    for name in ("../../elsewhere", "/etc", "step_00000002/../../../elsewhere"):
        (bad / "checkpoints" / "latest").write_text(name + "\n")
        with pytest.raises(UnsafeCheckpoint, match=r"leads out of .*refused, not followed"):
            train(RECIPE, OVER + ["train.max_steps=3"], run_dir=bad, resume="auto")
        with pytest.raises(UnsafeCheckpoint):
            load_for_eval(bad)
    # a tag dir that is a symlink leading out of checkpoints/ is no checkpoint of the run either
    (bad / "checkpoints" / "latest").unlink()
    (bad / "checkpoints" / ckpt.tag_for(9)).symlink_to(elsewhere, target_is_directory=True)
    assert [s for s, _ in ckpt.list_checkpoints(bad)] == [2]
    (bad / "checkpoints" / "latest").write_text(ckpt.tag_for(9) + "\n")
    with pytest.raises(UnsafeCheckpoint, match="refused, not followed"):
        ckpt.latest_checkpoint(bad)


def test_universal_conversion_never_unpickles_a_crafted_file(run, tmp_path, monkeypatch, capfd):
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    tag = ckpt.latest_checkpoint(bad)
    marker = tmp_path / "marker"
    torch.save({"state": Payload(marker)}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    ckpt.mark_complete(tag)
    with pytest.raises(UnsafeCheckpoint, match=r"optim_states.pt.*builtins.exec.*refused"):
        universal.to_universal(tag, tmp_path / "uni")  # the scan refuses it before DeepSpeed starts
    assert not (tmp_path / "uni").exists()
    # and were the scan skipped (or the file swapped after it), DeepSpeed's converter itself reads
    # every file weights-only: it fails, and the payload never runs
    monkeypatch.setattr(universal, "verify_checkpoint_dir", lambda d: 0)
    capfd.readouterr()
    with pytest.raises(subprocess.CalledProcessError):
        universal.to_universal(tag, tmp_path / "uni")
    assert re.search(r"UnsafeCheckpoint: .*optim_states.pt would import \['builtins.exec'\]", capfd.readouterr().err)
    assert not marker.exists() and not ckpt.is_complete(tmp_path / "uni" / tag.name)
    # the clean checkpoint converts, under the same guard, and is marked complete with its file list
    out = universal.to_universal(ckpt.latest_checkpoint(run), tmp_path / "clean")
    assert ckpt.is_complete(out) and ckpt.verify(out) == [] and ckpt.read_state(out)["universal"]


def test_the_file_loaded_is_the_file_scanned(run, tmp_path, monkeypatch):
    """A file swapped for a crafted one between the scan and the load is not what gets loaded:
    the scan and the load read one open file; DeepSpeed's loader is held to the same."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # deferred: heavy

    src = ckpt.latest_checkpoint(run) / "rng" / "rank0.pt"
    marker = tmp_path / "marker"
    crafted = tmp_path / "crafted.pt"
    torch.save({"state": Payload(marker)}, crafted)
    real_scan = pickle_scan.get_unsafe_globals_in_checkpoint

    def scan_then_swap(f):  # the attacker replaces the file right after the scan
        found = real_scan(f)
        shutil.copy(crafted, victim.with_suffix(".swap"))
        os.replace(victim.with_suffix(".swap"), victim)
        return found

    monkeypatch.setattr(pickle_scan, "get_unsafe_globals_in_checkpoint", scan_then_swap)
    for load in (safe_torch_load, lambda f: TorchCheckpointEngine().load(str(f), map_location="cpu")):
        victim = tmp_path / "victim.pt"
        shutil.copy(src, victim)
        with pickle_scan.guarded_torch_load():
            state = load(victim)
        assert set(state) >= {"torch", "numpy", "python"}  # the scanned (benign) bytes were loaded
        assert "builtins.exec" in real_scan(str(victim)) and not marker.exists()
    # even a file no scan looked at is unpickled weights-only inside DeepSpeed's loaders
    monkeypatch.setattr(pickle_scan, "get_unsafe_globals_in_checkpoint", lambda f: [])
    with pickle_scan.guarded_torch_load(), pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        TorchCheckpointEngine().load(str(crafted), map_location="cpu")
    assert not marker.exists()


def test_own_checkpoint_files_load_weights_only(run):
    tag = ckpt.latest_checkpoint(run)
    for f in sorted(tag.rglob("*.pt")):
        assert scan_pickle(f) == [], f
        safe_torch_load(f)  # torch.load(..., weights_only=True)
    model, meta = load_for_eval(tag)
    assert meta["step"] == 2


def test_the_allowlisted_deepspeed_classes_are_imported_only_for_a_file_that_names_one(run):
    """The optimizer states name DeepSpeed classes (they load: the test above); the model states do
    not, so evaluating a checkpoint never imports DeepSpeed and starts in a second or two."""
    tag = ckpt.latest_checkpoint(run)
    named = {f.name: [g for g in pickle_scan.pickle_globals(f) if g.startswith("deepspeed.")] for f in tag.glob("*.pt")}
    assert named["mp_rank_00_model_states.pt"] == [] and named["zero_pp_rank_0_mp_rank_00_optim_states.pt"], named
    code = (
        "import sys\nfrom checkpoint import load_for_eval\n"
        f"load_for_eval({str(tag)!r})\nprint('deepspeed' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert out.returncode == 0 and out.stdout.split()[-1] == "False", out.stdout + out.stderr[-2000:]


def test_recipe_yaml_is_parsed_never_executed(tmp_path):
    marker = tmp_path / "marker"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(RecipeError, match=r"evil.yaml:1:\d+: .*could not determine a constructor .*python/object"):
        load_recipe(recipe)
    assert not marker.exists()


def test_no_trust_remote_code_anywhere():
    hits = []
    for pkg in ("model", "pretrain", "data_pipeline", "eval"):
        for f in (REPO / pkg).rglob("*.py"):
            text = f.read_text()
            if re.search(r"trust_remote_code\s*=\s*True", text) or re.search(
                r"\byaml\.load\(|\bpickle\.loads?\(", text
            ):
                hits.append(str(f.relative_to(REPO)))
            if re.search(r"torch\.load\([^)]*weights_only\s*=\s*False", text):
                hits.append(str(f.relative_to(REPO)))
    assert hits == []
