"""DeepSpeed is imported without its autotuner's mlflow import (about 1.8 s a process), and mlflow
still imports and works afterwards, for the MLflow tracker; its Muon module's `torch.compile` runs at
the first call, not at import (about 1.1 s a rank)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from common.deepspeed_import import compile_on_first_call

CHECK = """
import sys, torch
REAL_COMPILE = torch.compile
from common.deepspeed_import import import_deepspeed
import_deepspeed()
print("mlflow loaded by deepspeed", "mlflow" in sys.modules)
from deepspeed.autotuning import autotuner
print("autotuner mlflow", autotuner.has_mlflow)
import mlflow
print("mlflow works", callable(mlflow.set_tracking_uri) and bool(mlflow.__version__))
print("again", import_deepspeed() is sys.modules["deepspeed"])
print("torch.compile restored", torch.compile is REAL_COMPILE)
print("inductor lowering loaded", "torch._inductor.lowering" in sys.modules)
from deepspeed.runtime.zero.muon import original_muon
print("muon deferred", original_muon.muon_update.__wrapped__.__name__ == "muon_update")
"""

PLAIN_IMPORT = """
import sys
sys.modules["mlflow"] = None
import deepspeed
print("torch._inductor.lowering" in sys.modules)
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    """This interpreter with the repository on its path, DeepSpeed on the CPU, and nothing else inherited."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"},
    )


def test_deepspeed_imports_without_mlflow_and_mlflow_works_after():
    pytest.importorskip("mlflow")
    out = _python("-c", CHECK)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["mlflow loaded by deepspeed"] == "False", out.stdout
    assert lines["autotuner mlflow"] == "False"  # DeepSpeed's autotuner logs without it
    assert lines["mlflow works"] == "True" and lines["again"] == "True"
    assert lines["torch.compile restored"] == "True" and lines["muon deferred"] == "True"
    # inductor is loaded only where `import deepspeed` itself loads it (DeepSpeed 0.19.6 does; 0.19.8 not)
    plain = _python("-c", PLAIN_IMPORT)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert lines["inductor lowering loaded"] == plain.stdout.split()[-1], (out.stdout, plain.stdout)


@pytest.mark.parametrize("as_factory", [False, True], ids=["compile(fn)", "compile()(fn)"])
def test_compile_on_first_call_compiles_once_at_the_first_call(as_factory):
    compiled = []

    def compile_fn(fn, **options):
        compiled.append(options)
        return lambda x: fn(x) * options.get("scale", 1)

    def double(x):
        return 2 * x

    deferred = (
        compile_on_first_call(compile_fn, scale=3)(double) if as_factory else compile_on_first_call(compile_fn, double)
    )
    assert compiled == [] and deferred.__name__ == "double"
    assert deferred(5) == (30 if as_factory else 10) and deferred(1) == (6 if as_factory else 2)
    assert compiled == ([{"scale": 3}] if as_factory else [{}])  # once, with the options given


def test_a_deepspeed_launcher_runs_as_main_through_it_and_nothing_else_does():
    launcher = _python("-m", "common.deepspeed_import", "deepspeed.launcher.launch", "--help")  # its own parser answers
    assert launcher.returncode == 0 and "--world_info" in launcher.stdout, launcher.stderr[-2000:]
    other = _python("-m", "common.deepspeed_import", "os")
    assert other.returncode == 1 and other.stderr.startswith("usage: python -m common.deepspeed_import deepspeed.")
