"""The forward of every variant at the `1b` shape in bf16 runs through the CUDA branches on fake
CUDA tensors, so dtype, device and shape errors there surface before a GPU sees them.

torch's FakeTensorMode makes `cuda` tensors with no storage. The model is built the way the
trainer builds it (meta device, activation checkpointing applied: pretrain/parallelize.py), its
parameters made as bf16 CUDA tensors (DeepSpeed's bf16 mode; the trainer uses no autocast), and
its loss taken as pretrain/engine.py takes it (chunked, reduction="sum", then float), with and
without per-document masking; attention picks its CUDA backend (kernels/select.py) and MixiT
runs the streamed path the CUDA rule picks on an 80 GiB device, the dense path and the Triton path
(forced), with only the kernel launches stubbed (the stub checks what each launch receives and
writes nothing). The 1b
shape is kept (width, heads, KV heads, vocabulary, T 2048) at two layers, since every layer
runs the same code.

What a CPU-only torch cannot rehearse, and the stand-ins (docs/PERFORMANCE.md):
  * a CUDA device guard: torch registers a no-op one only on a CUDA build without a device, so
    tests/fake_cuda_guard.cpp (compiled here in seconds) registers one in a subprocess of its own;
  * Python indexing of a fake CUDA tensor still fails, so it is routed to the aten ops it lowers
    to (select, slice, unsqueeze, index, index_put_);
  * MixiT's per-head sigmas are read with float(), which fake mode refuses: computed outside it;
  * the backward: autograd's engine asks for an accelerator the CPU build does not have, so only
    the forward runs (with no gradient recorded).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

import model.kernels.mixit_blocked as mixit_blocked_mod
import model.mixit as mixit_mod
from model import VARIANTS, preset
from model.kernels import mixit_streamed, mixit_triton, select
from model.transformer import Transformer
from pretrain.parallelize import apply_activation_checkpointing

REPO = Path(__file__).resolve().parent.parent
SEQ = 2048
LAYERS = 2
H100_MEMORY = 80 * 2**30
# (variant, mixit_impl) cases, and the kernels each launches: on CUDA `auto` streams the stored tiles
CASES = [(v, "auto") for v in VARIANTS] + [("mixit", "triton"), ("mixit", "dense")]
KERNELS = {("mixit", "auto"): {"generate", "streamed forward"}, ("mixit", "triton"): {"forward"}}


def _aten_getitem(x: torch.Tensor, index) -> torch.Tensor:
    """x[index] by the aten ops PyTorch's indexing lowers to: basic indexing, then one aten.index."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, bool) or (isinstance(i, torch.Tensor) and i.dtype == torch.bool) for i in items):
        raise NotImplementedError("boolean-mask indexing has a data-dependent shape")
    used = sum(1 for i in items if isinstance(i, (int, slice, torch.Tensor)))
    out, dim, advanced = x, 0, []
    for item in items:
        if item is Ellipsis:
            skip = x.dim() - used
            advanced += [None] * skip
            dim += skip
        elif item is None:
            out = out.unsqueeze(dim)
            advanced.append(None)
            dim += 1
        elif isinstance(item, int):
            out = out.select(dim, item)
        elif isinstance(item, slice):
            stop = out.shape[dim] if item.stop is None else item.stop
            out = torch.ops.aten.slice(out, dim, item.start or 0, stop, item.step or 1)
            advanced.append(None)
            dim += 1
        elif isinstance(item, torch.Tensor):
            advanced.append(item)
            dim += 1
        else:
            raise TypeError(f"index {item!r}")
    if any(a is not None for a in advanced):
        while advanced[-1] is None:
            advanced.pop()
        out = torch.ops.aten.index(out, advanced)
    return out


def _aten_setitem(x: torch.Tensor, index, value) -> None:
    items = index if isinstance(index, tuple) else (index,)
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=x.dtype, device=x.device)
    if any(isinstance(i, torch.Tensor) for i in items):
        if not all(isinstance(i, torch.Tensor) for i in items):
            raise NotImplementedError("assignment mixing tensor and basic indices")
        x.index_put_(tuple(items), value.to(x.dtype))
    else:
        _aten_getitem(x, index).copy_(value)


def _run_forward_checks() -> None:  # runs in the subprocess, after the guard is registered

    class AtenIndexing(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            if func is torch.Tensor.__getitem__ and args[0].is_cuda:
                return _aten_getitem(*args)
            if func is torch.Tensor.__setitem__ and args[0].is_cuda:
                return _aten_setitem(*args)
            return func(*args, **(kwargs or {}))

    class Sigmas(list):  # head_sigmas as Python floats, indexable and .float()-able like the tensor
        def __getitem__(self, i):
            got = super().__getitem__(i)
            return Sigmas(got) if isinstance(i, slice) else got

        def float(self):
            return self

    head_sigmas = mixit_mod.head_sigmas

    def real_head_sigmas(cfg, layer):
        with unset_fake_temporarily():
            return Sigmas(head_sigmas(cfg, layer).tolist())

    launches: list = []

    def float32_contiguous(args) -> None:  # the regenerating kernels: the autograd function upcasts
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert all(t.is_contiguous() for t in tensors), [(t.device, t.stride()) for t in tensors]
        assert all(t.dtype in (torch.float32, torch.int64) for t in tensors), [t.dtype for t in tensors]

    def streamed(stored: int):  # the streamed kernels: tiles (argument `stored`), values, output in bf16
        def check(args) -> None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            assert all(t.stride(-1) == 1 for t in tensors), [t.stride() for t in tensors]
            assert all(t.dtype in (torch.bfloat16, torch.float32, torch.int64) for t in tensors), [
                t.dtype for t in tensors
            ]
            tiles = args[stored]
            assert tiles.dtype == torch.bfloat16 and tiles.is_contiguous() and tiles.shape[-1] == mixit_streamed.TILE

        return check

    class LaunchStub:
        def __init__(self, name, check):
            self.name, self.check = name, check

        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                assert all(a.is_cuda for a in args if isinstance(a, torch.Tensor)), self.name
                self.check(args)
                assert all(isinstance(g, int) and g > 0 for g in grid), grid
                assert constexprs.get("SWEEP_N", 0) == 0  # compiled kernels keep the run-time loop bounds
                assert not constexprs.get("UPCAST", False)  # bf16 products on the tensor cores
                launches.append(self.name)

            return launch

    mixit_mod.head_sigmas = mixit_blocked_mod.head_sigmas = real_head_sigmas  # every module that holds the name
    regenerating = (LaunchStub("forward", float32_contiguous), LaunchStub("backward", float32_contiguous), None)
    mixit_triton._kernels = lambda: regenerating
    names = (("generate", 0), ("streamed forward", 3), ("streamed backward", 3))  # and where the tiles are
    stored = tuple(LaunchStub(name, streamed(i)) for name, i in names)
    mixit_streamed._kernels = lambda: stored
    select.triton_available = lambda: True
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=H100_MEMORY)

    with FakeTensorMode(allow_non_fake_inputs=True), AtenIndexing(), torch.no_grad():
        for variant, impl in CASES:
            for docs in (False, True) if _doc_masking(variant, impl) else (False,):
                mcfg = preset("1b", variant=variant, num_layers=LAYERS, max_seq_len=SEQ, mixit_impl=impl)
                with torch.device("meta"):
                    model = Transformer(mcfg, init_seed=0)
                model.set_step(0)
                assert apply_activation_checkpointing(model) == LAYERS
                made: dict[int, nn.Parameter] = {}
                for module in model.modules():
                    for name, p in list(module._parameters.items()):
                        if p is not None:
                            if id(p) not in made:  # tied tensors stay one Parameter
                                data = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda")
                                made[id(p)] = nn.Parameter(data, requires_grad=False)
                            module._parameters[name] = made[id(p)]
                x = torch.randint(0, mcfg.vocab_size, (2, SEQ), device="cuda")
                extra = {"doc_ids": torch.zeros(2, SEQ, dtype=torch.long, device="cuda")} if docs else {}
                before = len(launches)
                loss = model(x, labels=x, reduction="sum", **extra).float()
                assert loss.shape == () and loss.is_cuda and loss.dtype == torch.float32, (variant, loss)
                logits = model(x.narrow(1, 0, 16))
                assert logits.shape == (2, 16, mcfg.vocab_size) and logits.dtype == torch.bfloat16 and logits.is_cuda
                launched = set(launches[before:])
                assert launched == KERNELS.get((variant, impl), set()), (variant, impl, docs, launched)
                print(f"ok {variant} {impl} docs={docs}", flush=True)
    assert launches, "the Triton paths launched nothing"


def _doc_masking(variant: str, impl: str) -> bool:
    """Document masking is run where the model supports it: not for `shaped` (it refuses), and for
    MixiT through its dense gather (what doc masking always takes), once (under `auto`)."""
    return variant != "shaped" and impl == "auto"


def _guard_module(tmp: Path) -> Path | None:
    """Compile tests/fake_cuda_guard.cpp into tmp; None on a CUDA build (torch has its own guard)."""
    if torch.backends.cuda.is_built():
        return None
    cxx = shutil.which("g++") or shutil.which("c++")
    include = Path(torch.__file__).parent / "include"
    if cxx is None or not (include / "c10" / "core" / "impl" / "FakeGuardImpl.h").is_file():
        pytest.skip("a C++ compiler and torch's C++ headers are needed for the no-op CUDA guard")
    lib = Path(torch.__file__).parent / "lib"
    out = tmp / f"fake_cuda_guard{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = [cxx, "-O0", "-shared", "-fPIC", "-std=c++17", f"-I{include}", f"-I{sysconfig.get_paths()['include']}"]
    cmd += [str(REPO / "tests" / "fake_cuda_guard.cpp"), f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return tmp


def test_1b_forward_of_every_variant_on_fake_cuda(tmp_path):
    guard_dir = _guard_module(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    out = subprocess.run(
        [sys.executable, __file__, str(guard_dir or "")], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for variant, impl in CASES:
        for docs in (False, True) if _doc_masking(variant, impl) else (False,):
            assert f"ok {variant} {impl} docs={docs}" in out.stdout, out.stdout


if __name__ == "__main__":
    if sys.argv[1]:
        sys.path.insert(0, sys.argv[1])
        import fake_cuda_guard  # noqa: F401  # registers the no-op CUDA guard on import
    _run_forward_checks()
