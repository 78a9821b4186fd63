#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install what
# pyproject.toml asks for. Idempotent: a stamp of the dependency files makes a
# second call return in well under a second.
#   EXTRAS="dev"   extras to install (the test command adds dev; a GPU host adds gpu)
#   VENV=.venv     where the environment lives
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-}
PY=${PYTHON:-python3}

have_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then have_gpu=1; fi
if [ "$have_gpu" = 1 ]; then EXTRAS="${EXTRAS:+$EXTRAS,}gpu"; fi

# One stamp per set of extras; a run that needs no extras accepts any up-to-date stamp
# (every set includes the base dependencies), so demo.sh and tests/run never undo each other.
deps_hash=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)-$have_gpu
stamp_file="$VENV/.bootstrap-stamp-${EXTRAS:-base}"
for f in "$stamp_file" $( [ -z "${EXTRAS//gpu/}" ] && ls "$VENV"/.bootstrap-stamp-* 2>/dev/null ); do
  if [ -f "$f" ] && [ "$(cat "$f")" = "$deps_hash" ]; then exit 0; fi
done

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

# torch first: a CPU machine takes the CPU build (fast, no CUDA download);
# a GPU machine takes the default CUDA build.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ "$have_gpu" = 1 ]; then
    echo "[bootstrap] installing torch (CUDA build)"; pip_install "torch>=2.5"
  else
    echo "[bootstrap] installing torch==2.13.0 (CPU build)"; pip_install "torch==2.13.0"
  fi
fi

# Every other dependency, read from pyproject.toml (the one place lower bounds live).
mapfile -t reqs < <("$VENV/bin/python" - "$EXTRAS" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [e for e in sys.argv[1].split(",") if e and e != "gpu"]
for req in project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]:
    print(req)
PYEOF
)
echo "[bootstrap] installing ${#reqs[@]} packages (first run takes a few minutes)"
pip_install "${reqs[@]}"
if [[ ",$EXTRAS," == *",gpu,"* ]]; then
  # flash-attn builds against the installed torch; a failure leaves the SDPA path in use.
  "$VENV/bin/python" - <<'PYEOF' | xargs -r "$VENV/bin/python" -m pip install -q --no-build-isolation || echo "[bootstrap] GPU extras failed to install; SDPA attention will be used"
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]))
PYEOF
fi
echo "$deps_hash" > "$stamp_file"
echo "[bootstrap] environment ready: $VENV"
