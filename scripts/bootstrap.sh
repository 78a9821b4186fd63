#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv), install what pyproject.toml asks for that
# is not there yet, and install the project itself into it (editable: the folders stay where they are,
# and every `python -m ...` command works from any directory). Idempotent: a stamp of the dependency
# files makes a second call return in well under a second.
#   EXTRAS="dev"     extras to install (the test command adds dev; EXTRAS=gpu asks for flash-attn/Liger)
#   VENV=.venv       where the environment lives
#   PYTHON=python3   the interpreter the environment is made from. Where it already imports torch (a
#                    cluster module, a container image), the environment reuses its packages, torch
#                    included, and installs only what is missing: a second CUDA torch is never
#                    downloaded over an existing one, and with nothing missing no index is asked.
#   WHEELHOUSE=DIR   install from a folder of wheels only (pip --no-index --find-links DIR), for a
#                    host without network (scripts/device_wheels.sh builds one)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-}
PY=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-}

if [ -n "$WHEELHOUSE" ] && [ ! -d "$WHEELHOUSE" ]; then
  echo "error: WHEELHOUSE=$WHEELHOUSE is not a directory. Fix: build it with scripts/device_wheels.sh or unset WHEELHOUSE" >&2
  exit 2
fi
have_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then have_gpu=1; fi

# One stamp per set of extras; a run that needs no extras accepts any up-to-date stamp
# (every set includes the base dependencies), so demo.sh and tests/run never undo each other.
deps_hash=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)-$have_gpu
stamp_file="$VENV/.bootstrap-stamp-${EXTRAS:-base}"
for f in "$stamp_file" $( [ -z "$EXTRAS" ] && ls "$VENV"/.bootstrap-stamp-* 2>/dev/null ); do
  if [ -f "$f" ] && [ "$(cat "$f")" = "$deps_hash" ]; then exit 0; fi
done

if [ ! -x "$VENV/bin/python" ]; then
  if host_torch_version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    # Reuse the interpreter's packages. --system-site-packages covers a system python; a .pth file
    # listing the interpreter's own site directories covers one that is itself a virtual
    # environment (a venv made from a venv would otherwise see only the base installation).
    echo "[bootstrap] creating $VENV on top of $PY's packages (torch $host_torch_version)"
    # the interpreter's own pip serves the environment too (seconds saved; pip installs into the
    # environment it runs in)
    without_pip=()
    "$PY" -c "import pip" >/dev/null 2>&1 && without_pip=(--without-pip)
    "$PY" -m venv --system-site-packages "${without_pip[@]}" "$VENV"
    site_dir=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import sys, os; print("\n".join(p for p in sys.path if os.path.isdir(p) and os.path.basename(p) in ("site-packages", "dist-packages")))' \
      > "$site_dir/_host_packages.pth"
  else
    echo "[bootstrap] creating virtual environment in $VENV"
    "$PY" -m venv "$VENV"
  fi
fi
pip_from=()
[ -n "$WHEELHOUSE" ] && pip_from=(--no-index --find-links "$WHEELHOUSE")
# --no-compile: the bytecode is written once, in parallel, after the last install (below).
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check --no-compile -q "${pip_from[@]}" "$@"; }

# uv, where the environment holds its own torch: it resolves and installs the
# ~200 packages in seconds where pip takes minutes. It is given pip's own configuration (index,
# extra indexes, find-links, constraints), so both install from the same places, and the
# environment's torch pinned, so it is never replaced. Where uv is not on PATH, pip installs it into
# the environment first. Any failure returns non-zero, and pip installs instead. (A host's own torch
# lives outside the environment, where uv does not look: there pip installs.)
uv_install() {
  local uv pin args
  # the environment's torch as a constraint; a torch outside the environment (a host's) refuses uv
  pin=$("$VENV/bin/python" - 2>/dev/null <<'PYEOF'
import importlib.metadata as md
import os
import sys

torch = md.distribution("torch")
print(f"torch=={torch.version}")
sys.exit(not os.path.realpath(torch.locate_file("")).startswith(os.path.realpath(sys.prefix) + os.sep))
PYEOF
  ) || return 1
  uv=$(command -v uv 2>/dev/null) || { pip_install uv >/dev/null 2>&1 && uv="$VENV/bin/uv"; } || return 1
  mapfile -t args < <("$VENV/bin/python" - <<'PYEOF'
import subprocess
import sys

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
found: dict[str, tuple[int, str]] = {}  # pip's precedence: environment over [install] over [global]
for line in listed.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    rank = {":env:": 3, "install": 2, "global": 1}.get(section, 0)
    if rank >= found.get(name, (0, ""))[0]:
        found[name] = (rank, value.strip().strip("'\""))
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "-c"}
for name, flag in flags.items():
    for value in found.get(name, (0, ""))[1].split():
        print(flag)
        print(value)
if found.get("no-index", (0, ""))[1].lower() in ("1", "true", "yes", "on"):
    print("--no-index")
if "cert" in found:  # a certificate bundle for pip: uv reads the system's store (or SSL_CERT_FILE)
    print("--native-tls")
PYEOF
  )
  "$uv" pip install --python "$VENV/bin/python" -q --index-strategy unsafe-best-match -c <(printf '%s\n' "$pin") \
    "${args[@]}" "$@" || { echo "[bootstrap] uv failed; pip installs instead"; return 1; }
}

# torch first, and only where none is importable: a CPU machine takes the CPU build (fast, no CUDA
# download), a GPU machine the default CUDA build. An existing torch is never replaced.
host_torch=1
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  host_torch=0
  if [ "$have_gpu" = 1 ]; then
    torch_req=$(grep -o '"torch[<>=!~][^"]*"' pyproject.toml | tr -d '"')   # the bound pyproject.toml states
    echo "[bootstrap] installing $torch_req (CUDA build)"; pip_install "$torch_req"
  else
    echo "[bootstrap] installing torch==2.13.0 (CPU build)"; pip_install "torch==2.13.0"
  fi
fi

# Every other dependency, read from pyproject.toml (the one place lower bounds live), less what
# the environment already satisfies (torch always counts as satisfied: see above). The GPU extras
# are tried where this script installed torch itself or EXTRAS names gpu; a host's own torch
# comes with the host's own kernels.
want_gpu=0
if [[ ",$EXTRAS," == *",gpu,"* ]] || { [ "$have_gpu" = 1 ] && [ "$host_torch" = 0 ]; }; then want_gpu=1; fi
missing() {
  "$VENV/bin/python" - "$@" <<'PYEOF'
import importlib.metadata as md
import sys
import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # pip's own copy, present wherever pip is
    from pip._vendor.packaging.requirements import Requirement

pyproject = tomllib.load(open("pyproject.toml", "rb"))
project = pyproject["project"]
if sys.argv[1] == "gpu":
    reqs = project["optional-dependencies"]["gpu"]
else:
    extras = [e for e in sys.argv[2].split(",") if e and e != "gpu"]
    reqs = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    # what installing the project itself needs (below): it is built with the environment's own setuptools
    reqs += pyproject["build-system"]["requires"]


def satisfied(req: Requirement, extra: str = "") -> bool:
    if req.marker and not req.marker.evaluate({"extra": extra}):
        return True
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        return False
    if req.name.lower() != "torch" and not req.specifier.contains(version, prereleases=True):
        return False
    for e in req.extras:  # e.g. moto[server]: the extra's own requirements
        for sub in md.requires(req.name) or []:
            r = Requirement(sub)
            if r.marker and r.marker.evaluate({"extra": e}) and not satisfied(Requirement(str(r).split(";")[0]), e):
                return False
    return True


for req in reqs:
    if not satisfied(Requirement(req)):
        print(req)
PYEOF
}
missing_reqs=$(missing deps "$EXTRAS")   # (a failure here stops the script, unlike inside <(...))
mapfile -t reqs < <(printf '%s' "$missing_reqs" | sed '/^$/d')
if [ "${#reqs[@]}" -gt 0 ]; then
  echo "[bootstrap] installing ${#reqs[@]} packages: ${reqs[*]} (a first run takes a few minutes)"
  if [ -z "$WHEELHOUSE" ] && uv_install "${reqs[@]}"; then
    echo "[bootstrap] installed with uv"
  else
    pip_install "${reqs[@]}"
  fi
else
  echo "[bootstrap] every dependency is already installed"
fi
if [ "$want_gpu" = 1 ]; then
  missing_reqs=$(missing gpu)
  mapfile -t gpu_reqs < <(printf '%s' "$missing_reqs" | sed '/^$/d')
  # flash-attn builds against the installed torch; a failure leaves the SDPA path in use.
  if [ "${#gpu_reqs[@]}" -gt 0 ]; then
    pip_install --no-build-isolation "${gpu_reqs[@]}" || echo "[bootstrap] GPU extras failed to install; SDPA attention will be used"
  fi
elif [ "$have_gpu" = 1 ]; then
  echo "[bootstrap] using the host's torch and kernels; EXTRAS=gpu scripts/bootstrap.sh tries flash-attn and Liger"
fi
# The project itself, editable: its folders stay where they are and Python finds its packages (those
# pyproject.toml lists) from any working directory, after the directory's own. --no-deps: its
# dependencies are above; --no-build-isolation: built with the environment's setuptools (a build
# requirement, installed above), so no index is asked.
echo "[bootstrap] installing the project itself (editable, from $PWD)"
pip_install --no-deps --no-build-isolation -e .
# The bytecode of every package this environment holds, written now even where the caller's environment
# says not to write bytecode (PYTHONDONTWRITEBYTECODE, common in container images): without it each
# process compiles what it imports from source again (torch._dynamo and sympy alone: 7 of a tiny training
# run's 12 CPU-seconds). About a minute, once per environment. Only a cache: a file that does not compile
# (a package's template) is skipped, and an import that fails fails again, with its message, in a real run.
# The packages' own test folders (a seventh of the files) are left out: nothing here imports them (the
# pattern starts at the site folder, so an environment under a folder named test/ is still compiled).
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
tests_rx=$("$VENV/bin/python" -c "import re, sys; print(re.escape(sys.argv[1]) + '/(.+/)?tests?/')" "$site")
PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -m compileall -q -j 0 -x "$tests_rx" "$site" >/dev/null 2>&1 || true
echo "$deps_hash" > "$stamp_file"
echo "[bootstrap] environment ready: $VENV"
