"""scripts/bootstrap.sh on a GPU host with no network: it reuses the interpreter's torch and
packages and asks no index when nothing is missing; a wheelhouse installs what is missing without
an index; a fresh environment gets torch from pip and the rest from uv (pip where uv fails), from
the sources pip is configured with; every environment holds the project itself, editable, so its
modules import from any directory. Real processes: bootstrap itself, pip, uv, a fake `nvidia-smi`
that answers like a GPU host's."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEAD_INDEX = "http://127.0.0.1:9/simple"  # the discard port: nothing listens, a request fails at once


def offline_gpu_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a GPU host without network: nvidia-smi answers, every index is dead."""
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        PATH=f"{fake_bin}:{env['PATH']}",
        PIP_CONFIG_FILE=os.devnull,  # no configured extra index or find-links either
        PIP_INDEX_URL=DEAD_INDEX,
        PIP_RETRIES="0",
        PIP_TIMEOUT="5",
        PYTHON=sys.executable,  # this interpreter has torch and every dependency
        **extra,
    )
    return env


def installed(venv: Path) -> set[str]:
    """Distributions installed into the environment itself (not reused from the interpreter)."""
    return {p.name.split("-")[0].lower() for p in venv.glob("lib/python*/site-packages/*.dist-info")}


def bootstrap(env: dict[str, str], root: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(root / "scripts" / "bootstrap.sh")], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_gpu_host_offline_reuses_torch_and_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    env = offline_gpu_env(tmp_path, VENV=str(venv), EXTRAS="dev")
    out = bootstrap(env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "every dependency is already installed" in log, log
    assert "installing torch" not in log, log
    # a fresh venv holds pip (and setuptools on older Pythons) and the project itself; nothing else was installed
    assert installed(venv) <= {"pip", "setuptools", "trainable_parts"}, installed(venv)
    torch_file = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert torch_file.returncode == 0, torch_file.stderr
    import torch

    assert Path(torch_file.stdout.strip()) == Path(torch.__file__), "the environment imports another torch"

    # the project is installed (editable): its modules import from another directory, from this checkout
    elsewhere = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import eval, model; print(eval.__file__); print(model.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert [Path(f).parent.parent for f in elsewhere.stdout.split()] == [REPO, REPO], elsewhere.stdout

    # the stamp: a second call is a no-op
    t0 = time.perf_counter()
    again = bootstrap(env)
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
    assert time.perf_counter() - t0 < 5


def _write_wheel(folder: Path, name: str, version: str, files: dict[str, bytes] | None = None) -> Path:
    """A pure-Python wheel, as a wheelhouse would hold: `files` (paths in the wheel -> bytes), by default
    one module and the metadata."""
    dist_info = f"{name}-{version}.dist-info"
    files = files or {
        f"{name}.py": f"__version__ = {version!r}\n".encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    whl = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return whl


def _wheel_of_installed(folder: Path, name: str) -> Path:
    """A wheel of the distribution this interpreter has installed (a pure-Python one), for a find-links
    folder that must hold a real package."""
    dist = importlib.metadata.distribution(name)
    skip = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")
    files = {
        str(f): f.locate().read_bytes()
        for f in dist.files
        if "__pycache__" not in f.parts and not (f.parent.name.endswith(".dist-info") and f.name in skip)
    }
    return _write_wheel(folder, name, dist.version, files)


def _project_needing_the_probe(tmp_path: Path) -> Path:
    """A copy of the project whose dependencies are torch and one package nothing has yet."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "bootstrap.sh", root / "scripts" / "bootstrap.sh")
    pyproject = (REPO / "pyproject.toml").read_text()
    start = pyproject.index("dependencies = [\n")
    end = pyproject.index("]\n", start)
    (root / "pyproject.toml").write_text(
        pyproject[:start] + 'dependencies = [\n    "torch>=2.5",\n    "tp-wheelhouse-probe>=1.0",\n' + pyproject[end:]
    )
    return root


def test_wheelhouse_installs_what_is_missing_without_an_index(tmp_path):
    root = _project_needing_the_probe(tmp_path)  # the interpreter has torch, not the probe
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    _write_wheel(wheelhouse, "tp_wheelhouse_probe", "1.2")
    venv = tmp_path / "venv"

    # without the wheelhouse the dead index is asked and the install fails: the index is really dead
    env = offline_gpu_env(tmp_path, VENV=str(venv))
    failed = bootstrap(env, root)
    assert failed.returncode != 0, failed.stdout + failed.stderr

    # a caller that says not to write bytecode (as container images often do) still gets the environment's
    # bytecode, written once: otherwise every process compiles what it imports from source again
    out = bootstrap(dict(env, WHEELHOUSE=str(wheelhouse), PYTHONDONTWRITEBYTECODE="1"), root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "installing 1 packages: tp-wheelhouse-probe>=1.0" in out.stdout, out.stdout
    assert installed(venv) - {"pip", "setuptools"} == {"tp_wheelhouse_probe", "trainable_parts"}
    (probe,) = venv.glob("lib/python*/site-packages/tp_wheelhouse_probe.py")
    assert Path(importlib.util.cache_from_source(str(probe))).is_file(), "no bytecode for the installed module"


@pytest.mark.parametrize("uv_works", [True, False], ids=["uv", "uv fails: pip"])
def test_a_fresh_environment_installs_through_uv_from_pips_configuration(tmp_path, uv_works):
    """A fresh environment: pip installs torch, uv the rest, from the sources pip is configured with
    (here only a find-links folder, no index); a uv that fails leaves the install to pip."""
    base_python = Path(sys.base_prefix) / "bin" / "python3"
    probe = subprocess.run([str(base_python), "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{base_python} has a torch of its own: bootstrap would reuse it")
    root = _project_needing_the_probe(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _write_wheel(wheels, "torch", "2.13.0")  # stands in for torch: only its name and version count here
    _write_wheel(wheels, "tp_wheelhouse_probe", "1.2")
    _wheel_of_installed(wheels, "setuptools")  # the project's build requirement (older Pythons bundle an older one)
    tools = tmp_path / "tools"
    tools.mkdir()
    if uv_works:
        (tools / "uv").symlink_to(Path(sys.executable).parent / "uv")  # this environment's (a dev dependency)
    else:
        (tools / "uv").write_text("#!/bin/sh\necho 'uv: no network' >&2\nexit 2\n")
        (tools / "uv").chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIP_", "UV_")) and k not in ("VIRTUAL_ENV", "PYTHONPATH")
    }
    env.update(
        PATH=f"{tools}:/usr/bin:/bin",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(wheels),
        PYTHON=str(base_python),
        VENV=str(tmp_path / "venv"),
        UV_CACHE_DIR=str(tmp_path / "uv-cache"),
    )
    out = bootstrap(env, root)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert ("installed with uv" in log) == uv_works and ("uv failed; pip installs instead" in log) != uv_works, log
    assert installed(tmp_path / "venv") - {"pip", "setuptools"} == {"torch", "tp_wheelhouse_probe", "trainable_parts"}


def test_missing_wheelhouse_is_refused(tmp_path):
    env = offline_gpu_env(tmp_path, VENV=str(tmp_path / "venv"), WHEELHOUSE=str(tmp_path / "nowhere"))
    out = bootstrap(env)
    assert out.returncode == 2
    assert out.stderr.startswith("error: WHEELHOUSE=") and "Fix:" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and not (tmp_path / "venv").exists()
