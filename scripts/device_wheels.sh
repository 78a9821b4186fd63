#!/usr/bin/env bash
# Build the wheelhouse .whl/ for the lent GPU's image, which has no network: Python 3.12 (cp312,
# manylinux x86_64) with torch 2.11, triton 3.6, transformers 5.17 and numpy 2.5 (and what those
# pull in), but no DeepSpeed. The wheelhouse holds what training and the GPU tests need beyond that:
# DeepSpeed (built here from its sdist: 0.19.x publishes no wheel, and `pip download --only-binary`
# would silently pick a 2020 release) and those of the project's dependencies and their requirements
# that the image lacks (6 wheels, 4.8 MiB: DeepSpeed, hjson and the pydantic family).
#   scripts/device_wheels.sh          build .whl/ (needs network here; seconds to a minute)
#   scripts/device_wheels.sh --list   print the plan, download nothing
#   scripts/device_wheels.sh --all    everything pyproject.toml names, dev extra included (over 200 MiB,
#                                     more than a device call carries): a complete wheelhouse for
#                                     `WHEELHOUSE=DIR EXTRAS=dev scripts/bootstrap.sh` on an offline host
# scripts/gpu_check.sh installs .whl/ on the device (into a --target folder, beside the image).
# Left out (not needed to train on local data or to run the GPU tests): datasets (data preparation, HF
# classification data), lm-eval (evaluation harness), s3fs (remote data) and the lint and remote-storage
# test tools.
#   DEST=.whl  DEEPSPEED_VERSION=0.19.8  PYTHON=python3 (runs pip here; any version)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
PY=${PYTHON:-python3}
list_only=0 everything=0
for arg in "$@"; do
  case "$arg" in
    --list) list_only=1 ;;
    --all) everything=1 ;;
    *) echo "error: unknown option $arg. Fix: scripts/device_wheels.sh [--list] [--all]" >&2; exit 2 ;;
  esac
done
device_pip=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

"$PY" - "$DEST" "$DEEPSPEED_VERSION" "$list_only" "$everything" "${device_pip[@]}" <<'PYEOF'
import re
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

dest, deepspeed_version, list_only, everything = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
device_pip = sys.argv[5:]

# The image's packages, as listed for it on 2026-11-17 (its torch 2.11.0, triton 3.6.0, transformers 5.17.0,
# numpy 2.5.2 among them; the CUDA libraries, nvidia-* and cuda-*, besides). pydantic is not on that list
# and travels: the first device run (2026-11-26, H200) trained and ran the GPU tests with DeepSpeed, hjson
# and the pydantic family as the whole wheelhouse.
IMAGE = set(
    "absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi "
    "charset-normalizer click cloudpickle colorama contourpy cycler einops execnet filelock fonttools fsspec "
    "grpcio h11 h5py hf-xet httpcore httpx huggingface-hub idna iniconfig jinja2 joblib kiwisolver markdown "
    "markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict networkx ninja numpy "
    "nvidia-ml-py packaging pandas pillow pip pluggy propcache protobuf psutil py-cpuinfo pyarrow pygments "
    "pyparsing pytest pytest-xdist python-dateutil pyyaml regex requests rich safetensors scipy sentencepiece "
    "setuptools shellingham six sympy tensorboard tensorboard-data-server threadpoolctl tiktoken tokenizers "
    "torch tqdm transformers triton typer typing-extensions tzdata urllib3 werkzeug wheel xxhash yarl zipp".split()
)
# Not needed on the device (see the header): left out with everything they pull in.
LEFT_OUT = set(
    "datasets lm-eval tensorboard matplotlib scipy pyarrow s3fs aiohttp ruff import-linter moto".split()
)
if everything:  # --all: every dependency and the dev extra, for `WHEELHOUSE=DIR EXTRAS=dev scripts/bootstrap.sh`
    LEFT_OUT = set()
# Where the device's Python evaluates requirement markers.
DEVICE_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = project["dependencies"] + (project["optional-dependencies"]["dev"] if everything else [])
roots = [Requirement(r) for r in wanted]
roots = [r for r in roots if canonicalize_name(r.name) not in IMAGE | LEFT_OUT]
for i, r in enumerate(roots):
    if canonicalize_name(r.name) == "deepspeed":
        roots[i] = Requirement(f"deepspeed=={deepspeed_version}")

if list_only:
    print(f"wheelhouse {dest}/ for cp312 manylinux x86_64 (the device image)")
    for r in roots:
        how = "built from its sdist (pip wheel --no-deps)" if r.name == "deepspeed" else "binary wheel"
        print(f"  {r}  {how}, with its requirements")
    print("  image provides: " + " ".join(sorted(IMAGE)))
    print("  left out: " + " ".join(sorted(LEFT_OUT)))
    sys.exit(0)


def pip(*args) -> bool:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    print("+ " + " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd).returncode == 0


def requirements_of(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if re.match(r"[^/]+\.dist-info/METADATA$", n))
        msg = Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if not r.marker or r.marker.evaluate(DEVICE_ENV)]


dest.mkdir(parents=True, exist_ok=True)
for old in dest.glob("*.whl"):
    old.unlink()
done: set[str] = set()
queue = list(roots)
while queue:
    req = queue.pop(0)
    name = canonicalize_name(req.name)
    if name in done or name in IMAGE or name in LEFT_OUT or name.startswith(("nvidia-", "cuda-")):
        continue
    done.add(name)
    before = set(dest.glob("*.whl"))
    # a binary wheel for the device; where a release is an sdist only (DeepSpeed 0.19.x, some small
    # pure-Python packages), its wheel is built here, and accepted only if it is pure Python
    built = name == "deepspeed" or not pip("download", "--no-deps", *device_pip, "--dest", str(dest), str(req))
    if built and not pip("wheel", "--no-deps", "--wheel-dir", str(dest), str(req)):
        sys.exit(f"error: no wheel of {req} for the device. Fix: check the name and version, and the network")
    (wheel,) = set(dest.glob("*.whl")) - before
    if built and not wheel.name.endswith("-none-any.whl"):
        sys.exit(f"error: {wheel.name} was built for this machine, not the device. Fix: build it with Python 3.12")
    queue += requirements_of(wheel)

wheels = sorted(dest.glob("*.whl"))
total = sum(w.stat().st_size for w in wheels)
for w in wheels:
    print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}/")
PYEOF
