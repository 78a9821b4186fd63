"""Training-loss curves of several runs: binned by step, tabled by tenths, plotted against step or schedule."""

from __future__ import annotations

import json
import math
import random

import pytest
import yaml

from pretrain.metrics import Logger, last_step
from studies.loss_curves import binned, main, parse_run, read_run

PNG = b"\x89PNG\r\n\x1a\n"


def _run(path, losses: dict[int, float], max_steps: int | None):
    """A run directory as the trainer leaves it: metrics.jsonl written by its Logger, and config.yaml."""
    path.mkdir(parents=True)
    log = Logger(path, enabled=True, progress_bar="off", total_steps=max_steps or 0, start_step=0)
    for step, loss in losses.items():
        log.log({"step": step, "loss": loss, "lr": 1e-3})
    log.log({"step": max(losses), "eval_loss": 9.0})  # a record without a training loss is not a point
    log.close()
    cfg = {"seed": 1, "train": {"max_steps": max_steps} if max_steps else {}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    return path


def test_binned_means_equal_step_ranges_and_skips_empty_ones():
    rng = random.Random(0)
    pts = [(s, rng.uniform(0, 5)) for s in range(10, 1001, 10)]
    bins = binned(pts, 10)
    assert [e for e, _ in bins] == list(range(100, 1001, 100))
    for end, mean in bins:
        xs = [loss for s, loss in pts if end - 100 < s <= end]
        assert math.isclose(mean, sum(xs) / len(xs))
    # a run resumed at step 600 with nothing logged before: only the ranges it logged
    later = [(s, loss) for s, loss in pts if s > 600]
    assert [e for e, _ in binned(later, 10)] == [700, 800, 900, 1000]


def test_table_reads_tenths_and_the_last_fifth(tmp_path, capsys):
    # loss falls linearly 3 -> 1 over 1000 steps, then a run at half the length, still under way (400 of 500)
    a = _run(tmp_path / "a", {s: 3 - 2 * s / 1000 for s in range(10, 1001, 10)}, 1000)
    b = _run(tmp_path / "b", {s: 2.0 for s in range(10, 401, 10)}, 500)
    out = tmp_path / "fig" / "curves.png"
    assert main([f"{a}=long", str(b), "--fraction", "--points", "20", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # tenth i of run a: mean over steps (100 i, 100 (i + 1)] = 3 - 2 (100 i + 55) / 1000
    tenths = " | ".join(f"{3 - 2 * (100 * i + 55) / 1000:.3f}" for i in range(10))
    # the last fifth: mean over steps 810-850 (1.38 ... 1.30: 1.34) minus mean over 960-1000 (1.04)
    assert f"| long | 1,000 / 1,000 | {tenths} | 0.300 |" in printed
    assert f"| {b} | 400 / 500 | " + " | ".join(["2.000"] * 10) + " | 0.000 |" in printed
    assert out.read_bytes()[:8] == PNG


def test_parse_run_and_refusals(tmp_path, capsys):
    a = _run(tmp_path / "a", {10: 1.0}, None)
    assert parse_run(f"{a}=my label") == (a, "my label")
    assert parse_run(str(a)) == (a, str(a))
    assert read_run(a) == ([(10, 1.0)], None)
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    assert "has no metrics.jsonl. Fix:" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "has no training loss yet. Fix:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(a), "--points", "0"])
    assert e.value.code == 2 and "--points 0 is not a positive count. Fix:" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_last_step_reads_a_metrics_file_being_written(tmp_path):
    assert last_step(tmp_path) == 0  # nothing logged yet
    lines = [json.dumps({"step": 1, "loss": 2.0}), json.dumps({"step": 2, "loss": 1.5}), '{"step": 3, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert last_step(tmp_path) == 2  # the torn last line is skipped
