"""DeepSpeed is imported without its autotuner's mlflow import (about 1.8 s a process), and mlflow
still imports and works afterwards, for the MLflow tracker."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

CHECK = """
import sys, torch
from common.deepspeed_import import import_deepspeed
import_deepspeed()
print("mlflow loaded by deepspeed", "mlflow" in sys.modules)
from deepspeed.autotuning import autotuner
print("autotuner mlflow", autotuner.has_mlflow)
import mlflow
print("mlflow works", callable(mlflow.set_tracking_uri) and bool(mlflow.__version__))
print("again", import_deepspeed() is sys.modules["deepspeed"])
"""


def test_deepspeed_imports_without_mlflow_and_mlflow_works_after():
    pytest.importorskip("mlflow")
    out = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["mlflow loaded by deepspeed"] == "False", out.stdout
    assert lines["autotuner mlflow"] == "False"  # DeepSpeed's autotuner logs without it
    assert lines["mlflow works"] == "True" and lines["again"] == "True"


def test_a_deepspeed_launcher_runs_as_main_through_it_and_nothing_else_does():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "common.deepspeed_import", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={"PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"},
        )

    launcher = run("deepspeed.launcher.launch", "--help")  # its own argument parser answers
    assert launcher.returncode == 0 and "--world_info" in launcher.stdout, launcher.stderr[-2000:]
    other = run("os")
    assert other.returncode == 1 and other.stderr.startswith("usage: python -m common.deepspeed_import deepspeed.")
