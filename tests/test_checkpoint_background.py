"""Background checkpoint saves (`checkpoint.background: true`, pretrain/checkpoint_writer.py): training
goes on while a save is written, the tag is marked complete only after its files are on disk, a
kill in the middle of the background write loses only that checkpoint, and a resume from a
background save continues exactly. (A full disk during a background save: test_reliability_faults.py;
the chaos run with background saves: test_chaos.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, read_losses
from test_reliability_durability import OVER, RECIPE

from checkpoint import tag_format as ckpt
from common.errors import RecipeError
from pretrain import faults
from pretrain.train import train

PAUSE_S = 1.5


def test_the_step_goes_on_while_a_save_is_written_and_a_resume_from_it_is_exact(tmp_path, monkeypatch):
    ref = train(RECIPE, OVER, run_dir=tmp_path / "ref", resume="never")
    # Every save sleeps PAUSE_S after its files are written and before its marker: in the background,
    # on the writer's thread, so the step is not blocked for it.
    monkeypatch.setenv(faults.ENV, json.dumps({"save_pause_s": PAUSE_S}))
    run = tmp_path / "bg"
    res = train(RECIPE, [*OVER, "checkpoint.background=true"], run_dir=run, resume="never")
    assert res.losses == ref.losses  # the same run, bitwise
    assert [t.step for t in res.saves] == [3, 6, 8]
    first = res.saves[0]
    assert first.blocked_s < PAUSE_S <= first.complete_s  # the pause was off the step's path
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [3, 6, 8]
    for _, tag in ckpt.list_checkpoints(run):
        assert ckpt.verify(tag) == []
        for name in ("frozen-stage0.safetensors", "rng/rank0.pt"):  # the same bytes a synchronous save writes
            assert (tag / name).read_bytes() == (ckpt.ckpt_root(tmp_path / "ref") / tag.name / name).read_bytes()
    monkeypatch.delenv(faults.ENV)
    branch = tmp_path / "from6"
    resumed = train(RECIPE, OVER, run_dir=branch, resume=str(ckpt.ckpt_root(run) / ckpt.tag_for(6)))
    assert resumed.losses == {k: v for k, v in ref.losses.items() if k > 6}


def last_logged_step(run) -> int:
    return max(read_losses(run), default=0) if (run / "metrics.jsonl").is_file() else 0


def test_a_kill_during_the_background_write_loses_only_that_checkpoint(tmp_path):
    run = tmp_path / "run"
    over = [*OVER, "checkpoint.background=true", "train.max_steps=12"]
    env = {
        "PYTHONPATH": str(REPO),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        faults.ENV: json.dumps({"save_pause_s": 60, "save_pause_steps": [6]}),
        "PATH": "/usr/bin:/bin",
    }
    cmd = [sys.executable, "-m", "pretrain.train", "--recipe", RECIPE, "--run-dir", str(run), *over]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = ckpt.ckpt_root(run) / ckpt.tag_for(6)
    try:
        deadline = time.time() + 120
        # the writer sleeps before marking step 6 complete; the steps after it go on meanwhile
        while time.time() < deadline and not ((partial / "rng" / "rank0.pt").is_file() and last_logged_step(run) >= 7):
            assert proc.poll() is None, "training ended before the checkpoint of step 6 was written"
            time.sleep(0.05)
        assert last_logged_step(run) >= 7  # training went on past the save in flight
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert partial.is_dir() and not ckpt.is_complete(partial)
    assert ckpt.latest_checkpoint(run).name == ckpt.tag_for(3)  # `latest` never moved to the partial one
    resumed = train(RECIPE, over, run_dir=run, resume="auto")
    assert resumed.resumed_from.name == ckpt.tag_for(3) and resumed.final_step == 12
    ref = train(RECIPE, over, run_dir=tmp_path / "ref", resume="never")
    assert read_losses(run) == ref.losses


def test_a_bad_background_value_is_refused_before_training(tmp_path):
    with pytest.raises(RecipeError, match="checkpoint.background"):
        train(RECIPE, [*OVER, "checkpoint.background=maybe"], run_dir=tmp_path / "run", resume="never")
    assert not (tmp_path / "run" / "checkpoints").exists()
