"""DeepSpeed, imported without two start-up costs this project never needs.

`import deepspeed` imports mlflow (when installed) for its autotuner, a launcher mode this project
never uses: about 1.8 s of every DeepSpeed process's start. `import_deepspeed` hides mlflow from that
one import and restores the name at once, so `logging.mlflow` still imports the real package. (A
`LazyLoader` module does not work: torch's and DeepSpeed's start-up walk `sys.modules` through
`inspect.getmodule`, which loads every lazy module it touches.) Every DeepSpeed optimizer wrapper
also imports DeepSpeed's Muon module, which wraps its functions in `torch.compile` at import and so
imports torch's inductor (about 1.1 s); that module is imported once with each compile deferred to
the function's first call (the same compile, later).

`python -m common.deepspeed_import MODULE ARGS...` runs one of DeepSpeed's launcher modules the same
way, as launch.sh does (a launcher starts in about 2.3 s instead of 4)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import runpy
import sys
from types import ModuleType

import torch

HIDDEN = ("mlflow",)
COMPILED_AT_IMPORT = ("deepspeed.runtime.zero.muon.muon_optimizer",)  # absent from older DeepSpeed: skipped


def import_deepspeed() -> ModuleType:
    """The deepspeed package; on the first import in a process, HIDDEN are hidden from it. Where no CUDA
    device is visible, DeepSpeed's accelerator is the CPU, said in DS_ACCELERATOR (unless it is set), as
    a CPU run sets it (pretrain/distributed.py): DeepSpeed's own detection comes to the same answer with a
    warning line on every import (an export, an evaluation of a DeepSpeed checkpoint)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    hidden = [name for name in HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import mlflow` raises ImportError: DeepSpeed's optional path
    try:
        import deepspeed  # deferred: heavy (several seconds to import)
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    real_compile = torch.compile
    torch.compile = functools.partial(compile_on_first_call, real_compile)
    try:
        for name in COMPILED_AT_IMPORT:
            with contextlib.suppress(ModuleNotFoundError):
                importlib.import_module(name)
    finally:
        torch.compile = real_compile
    return deepspeed


def compile_on_first_call(compile_fn, model=None, **options):
    """`compile_fn(model, **options)` (torch.compile's signature, also as a decorator factory), run at
    the first call of the returned function instead of now."""
    if model is None:
        return functools.partial(compile_on_first_call, compile_fn, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = compile_fn(model, **options)
        return compiled(*args, **kwargs)

    return call


def run_module(module: str, args: list[str]) -> None:
    """Run DeepSpeed's `module` as `python -m module args` would, DeepSpeed imported by import_deepspeed."""
    import_deepspeed()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not sys.argv[1].startswith("deepspeed."):
        sys.exit("usage: python -m common.deepspeed_import deepspeed.MODULE [ARGS...]")
    run_module(sys.argv[1], sys.argv[2:])
