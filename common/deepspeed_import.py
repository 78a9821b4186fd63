"""DeepSpeed, imported without its autotuner's eager import of mlflow.

`import deepspeed` imports mlflow whenever mlflow is installed, for its autotuner's experiment
logging (`deepspeed --autotuning`, a launcher mode this project never uses): about 1.8 s of every
DeepSpeed process's start, most of a rank's start-up after torch. `import_deepspeed` hides mlflow
from that one import, so DeepSpeed records mlflow as absent for its autotuner; the name is restored
at once, and a process that logs to MLflow (`logging.mlflow`) imports the real package as usual.
A lazy module (`importlib.util.LazyLoader`) does not work here: torch's and DeepSpeed's start-up
walk `sys.modules` through `inspect.getmodule`, which loads every lazy module it touches.

`python -m common.deepspeed_import MODULE ARGS...` runs one of DeepSpeed's launcher modules
(`deepspeed.launcher.launch`, `deepspeed.launcher.runner`) the same way, as launch.sh does: a
launcher process starts in about 2.3 s instead of 4."""

from __future__ import annotations

import runpy
import sys
from types import ModuleType

HIDDEN = ("mlflow",)


def import_deepspeed() -> ModuleType:
    """The deepspeed package; on the first import in a process, HIDDEN are hidden from it."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hidden = [name for name in HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import mlflow` raises ImportError: DeepSpeed's optional path
    try:
        import deepspeed  # deferred: heavy (several seconds to import)
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    return deepspeed


def run_module(module: str, args: list[str]) -> None:
    """Run DeepSpeed's `module` as `python -m module args` would, DeepSpeed imported by import_deepspeed."""
    import_deepspeed()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not sys.argv[1].startswith("deepspeed."):
        sys.exit("usage: python -m common.deepspeed_import deepspeed.MODULE [ARGS...]")
    run_module(sys.argv[1], sys.argv[2:])
