#!/usr/bin/env bash
# Build an environment with a named set of dependency versions and run the CPU test suite in it, so
# the code is known to run on versions other than the development environment's.
#   scripts/compat.sh device    the lent GPU image: Python 3.12, torch 2.11.0, triton 3.6.0,
#                               transformers 5.17.0, numpy 2.5.2 (everything else: the newest release)
#   scripts/compat.sh lowest    Python 3.11 (requires-python) and the lower bounds pyproject.toml claims for torch, deepspeed,
#                               transformers, numpy, safetensors, sentencepiece, pinned exactly
#   scripts/compat.sh NAME --setup-only        build the environment, run nothing
#   scripts/compat.sh NAME -x tests/test_mixit.py   extra arguments go to pytest
# PYTHON=/path/to/python3.X picks the interpreter (default: python3.12 / python3.11 on PATH).
# The environment lives in COMPAT_DIR (default /tmp/trainable-parts-compat/NAME) and is reused by the
# next call. Not part of CI: the first call downloads a full torch (several GB with its CUDA
# libraries; it runs on a CPU all the same) and the suite takes 10-20 minutes. docs/TRAINING.md
# records which sets were run and how they fared.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-}
[ $# -gt 0 ] && shift
case "$name" in
  device) python_version=3.12 ;;
  lowest) python_version=3.11 ;;
  *)
    echo "error: unknown version set '${name}'. Fix: scripts/compat.sh device|lowest [pytest args]" >&2
    exit 2
    ;;
esac
PY=${PYTHON:-python$python_version}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "error: no $PY for the '$name' set. Fix: PYTHON=/path/to/python$python_version scripts/compat.sh $name" >&2
  exit 2
fi
env_dir=${COMPAT_DIR:-/tmp/trainable-parts-compat/$name}

# Requirements: the project's dependencies and its dev extra (tests, lint), each with pins where the set has them.
parse_py=$PY
"$parse_py" -c "import tomllib" 2>/dev/null || parse_py=python3   # tomllib: Python >= 3.11
mapfile -t reqs < <("$parse_py" - "$name" <<'PYEOF'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps, dev = project["dependencies"], project["optional-dependencies"]["dev"]
if sys.argv[1] == "device":
    pins = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "numpy": "2.5.2"}
    for req in deps + dev:
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
        print(f"{name}=={pins[name]}" if name in pins else req)
else:
    # the lower bound, exactly, of every library the model and the trainer compute with; the rest
    # (data, evaluation, plotting and test tools) as pip resolves them against those (pinning every
    # bound at once has no solution: transformers 4.45 needs safetensors >= 0.4.1; with tqdm 4.66.0
    # pinned too, pip's backtracking over the remainder did not finish in 20 minutes)
    core = {"torch", "deepspeed", "transformers", "numpy", "safetensors", "sentencepiece"}
    for req in deps + dev:
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
        print(req.replace(">=", "==") if name in core else req)
PYEOF
)
stamp="$env_dir/.compat-stamp"
want=$(printf '%s\n' "${reqs[@]}" | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[compat] building $env_dir with $("$PY" -V) and: ${reqs[*]}"
  rm -rf "$env_dir"
  "$PY" -m venv "$env_dir"
  "$env_dir/bin/python" -m pip install -q --disable-pip-version-check "${reqs[@]}"
  echo "$want" > "$stamp"
fi
"$env_dir/bin/python" - <<'PYEOF'
import importlib.metadata as md, sys
names = ["torch", "triton", "transformers", "numpy", "deepspeed", "datasets", "lm_eval", "safetensors", "pytest"]
print("[compat] python " + sys.version.split()[0] + ", " + ", ".join(f"{n} {md.version(n)}" for n in names))
PYEOF
[ "${1:-}" = --setup-only ] && exit 0

export DS_ACCELERATOR=cpu PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# PYTHON named the interpreter the environment is made from; launch.sh and the tests read it as theirs
export PATH="$env_dir/bin:$PATH" VIRTUAL_ENV="$env_dir" PYTHON="$env_dir/bin/python"
exec "$env_dir/bin/python" -m pytest -q -p no:cacheprovider "$@"
