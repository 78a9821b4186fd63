"""Durability: a checkpoint's files reach the disk (fsync) before its COMPLETE marker, the marker
lists every file with its size (and a checksum for the small ones), and a checkpoint damaged after
the marker (a power loss that truncated a file, a flipped byte, a lost file) is passed over by
`--resume auto`, which falls back to the previous intact checkpoint and says so."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from conftest import read_losses

from checkpoint import load_for_eval
from checkpoint import tag_format as ckpt
from common.errors import RecipeError
from pretrain.train import train

RECIPE = "recipes/tiny_cpu.yaml"
OVER = [
    "train.eval_every_steps=0",
    "logging.tensorboard=false",
    "train.max_steps=8",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=0",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    res = train(RECIPE, OVER, run_dir=d, resume="never")
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [3, 6, 8]
    return d, res.losses


def test_files_are_fsynced_before_the_marker_and_the_marker_lists_them(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("rename", os.path.realpath(dst)))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    res = train(RECIPE, OVER + ["train.max_steps=3"], run_dir=tmp_path, resume="never")
    tag = os.path.realpath(res.last_checkpoint)
    listed = json.loads((res.last_checkpoint / ckpt.COMPLETE).read_text())["files"]
    on_disk = {
        p.relative_to(res.last_checkpoint).as_posix(): p.stat().st_size
        for p in res.last_checkpoint.rglob("*")
        if p.is_file() and p.name != ckpt.COMPLETE
    }
    assert {k: v["bytes"] for k, v in listed.items()} == on_disk  # every file, its size
    assert all("sha256" in v for k, v in listed.items() if v["bytes"] <= ckpt.CHECKSUM_MAX_BYTES)
    marker = events.index(("rename", os.path.join(tag, ckpt.COMPLETE)))
    synced = {p for kind, p in events[:marker] if kind == "fsync"}
    assert {os.path.join(tag, k) for k in listed} <= synced  # each file before the marker
    assert {tag, os.path.join(tag, "rng")} <= synced  # and the directories holding them
    assert ("fsync", os.path.join(tag, f"{ckpt.COMPLETE}.tmp{os.getpid()}")) in events[:marker]
    latest = events.index(("rename", os.path.realpath(tmp_path / "checkpoints" / "latest")))
    assert marker < latest and ("fsync", os.path.realpath(tmp_path / "checkpoints")) in events[latest:]


def truncate(tag, rel):
    f = tag / rel
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def flip_a_byte(tag, rel):
    f = tag / rel
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    "optimizer states truncated": (
        truncate,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "has \\d+ bytes, the marker lists",
    ),
    "a flipped byte in the RNG state": (flip_a_byte, "rng/rank0.pt", "rng/rank0.pt fails its sha256 check"),
    "model states lost": (lambda tag, rel: (tag / rel).unlink(), "mp_rank_00_model_states.pt", "is missing"),
    "the marker truncated": (truncate, ckpt.COMPLETE, "not a valid file list"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_auto_falls_back_past_a_damaged_checkpoint_and_says_so(run, tmp_path, capsys, damage):
    src, losses = run
    d = tmp_path / "run"
    shutil.copytree(src, d)
    hurt, rel, why = DAMAGE[damage]
    hurt(d / "checkpoints" / ckpt.tag_for(8), rel)
    capsys.readouterr()
    res = train(RECIPE, OVER, run_dir=d, resume="auto")
    out = capsys.readouterr().out
    assert res.resumed_from.name == ckpt.tag_for(6)
    assert f"checkpoint {d / 'checkpoints' / ckpt.tag_for(8)} fails verification" in out and re.search(why, out)
    assert f"resumed from {d / 'checkpoints' / ckpt.tag_for(6)}" in out
    assert read_losses(d) == losses  # steps 7 and 8 again, bitwise
    assert ckpt.verify(d / "checkpoints" / ckpt.tag_for(8)) == []  # rewritten whole


def test_a_damaged_checkpoint_named_explicitly_is_refused(run, tmp_path):
    src, _ = run
    d = tmp_path / "run"
    shutil.copytree(src, d)
    tag = d / "checkpoints" / ckpt.tag_for(8)
    truncate(tag, "mp_rank_00_model_states.pt")
    with pytest.raises(RecipeError, match=r"fails verification \(mp_rank_00_model_states.pt has \d+ bytes.*earlier"):
        train(RECIPE, OVER, run_dir=tmp_path / "other", resume=str(tag))
    with pytest.raises(FileNotFoundError, match="fails verification"):
        load_for_eval(tag)
    assert load_for_eval(d)[1]["step"] == 6  # a run dir: its newest intact checkpoint
    for step in (3, 6):
        truncate(d / "checkpoints" / ckpt.tag_for(step), "rng/rank0.pt")
    with pytest.raises(RecipeError, match="none is intact.*--resume never --overwrite"):
        train(RECIPE, OVER, run_dir=d, resume="auto")  # never silently starts over


def test_a_checkpoint_marked_before_file_lists_existed_still_loads(run, tmp_path):
    src, losses = run
    d = tmp_path / "run"
    shutil.copytree(src, d)
    for step in (3, 6, 8):
        (d / "checkpoints" / ckpt.tag_for(step) / ckpt.COMPLETE).write_text("ok\n")  # the old marker
    (d / "checkpoints" / "latest").write_text(ckpt.tag_for(6) + "\n")
    res = train(RECIPE, OVER, run_dir=d, resume="auto")
    assert res.resumed_from.name == ckpt.tag_for(6) and read_losses(d) == losses
