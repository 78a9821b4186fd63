"""Progress written to a log (CI, Slurm, `> log`) stays short: compact lines at most every 5% of
the work or 30 s instead of a tqdm bar redrawn line by line; a terminal still gets the bar."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

from conftest import REPO

from data_pipeline import progress as P
from model import preset
from model.io import save_native
from model.transformer import build_model

ENV = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
BAR = re.compile(r"\d+%\|.*\|")  # a tqdm bar: "45%|████▌     | 9/20"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_log_progress_prints_a_bounded_number_of_lines(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(P.time, "monotonic", clock)
    out = io.StringIO()
    bar = P.progress_bar(total=10_000, desc="training", unit="step", file=out)
    assert isinstance(bar, P.LogProgress)  # a StringIO is not a terminal
    for _ in range(10_000):  # 10,000 updates over 500 simulated seconds
        clock.t += 0.05
        bar.update(1)
        bar.set_postfix_str("run a")
    bar.close()
    lines = out.getvalue().splitlines()
    assert 20 <= len(lines) <= 20 + 500 / 30 + 1, lines
    assert lines[-1].startswith("training: 10,000/10,000 step (100%), 8m20s elapsed") and lines[-1].endswith("run a")
    assert "~" in lines[0] and "left" in lines[0]

    out = io.StringIO()  # quick work: its final line only
    for _ in P.progress_bar(range(50), desc="quick", file=out):
        clock.t += 0.001
    assert out.getvalue().splitlines() == ["quick: 50/50 it (100%), 0s elapsed"]

    out = io.StringIO()  # unknown total: one line per 30 s
    bar = P.progress_bar(desc="prepare", unit="tok", file=out)
    for _ in range(100):
        clock.t += 3
        bar.update(1000)
    bar.close()
    assert len(out.getvalue().splitlines()) == 9 + 1  # at 33, 63, ..., 273 s, and the final one


def test_a_terminal_still_gets_a_tqdm_bar():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(P.progress_bar(total=3, file=Tty()), P.LogProgress)


def _run_to_file(args, log):
    with open(log, "w") as f:
        p = subprocess.run(
            [sys.executable, "-m", *args], cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT, timeout=600
        )
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    return text


def test_trainer_logs_one_line_per_record_with_the_bar_on(tmp_path):
    text = _run_to_file(
        [
            "pretrain.train",
            "--recipe",
            "recipes/tiny_cpu.yaml",
            "--run-dir",
            str(tmp_path / "r"),
            "logging.progress_bar='on'",
            "logging.every_steps=1",
            "train.max_steps=20",
            "logging.tensorboard=false",
        ],
        tmp_path / "train.log",
    )
    assert "\r" not in text and not BAR.search(text)
    assert len([line for line in text.splitlines() if line.startswith("step ")]) == 20


def test_eval_progress_in_a_log_is_a_few_lines(tmp_path):
    save_native(build_model(preset("tiny", vocab_size=64, max_seq_len=128), seed=0), tmp_path / "ck", {"step": 1})
    text = _run_to_file(
        [
            "eval.run",
            "--checkpoint",
            str(tmp_path / "ck"),
            "--tasks",
            "induction,kv_recall,synthetic:kv_retrieval",
            "--synthetic-n",
            "512",
            "--n",
            "64",
            "--out",
            str(tmp_path / "r.json"),
        ],
        tmp_path / "eval.log",
    )
    assert "\r" not in text and not BAR.search(text)
    progress = [line for line in text.splitlines() if re.match(r"[\w:]+: \d", line)]
    assert 3 <= len(progress) <= 3 * (20 + 1), progress  # each task: at most one line per 5%
