"""The project's Triton kernels compiled for Hopper (sm_90) ahead of time, on a machine without a GPU.

Triton compiles for a CUDA target it is given; the `ptxas` it ships assembles the PTX (with `-v`:
registers, shared memory, spills) and its `nvdisasm` shows the machine code. The Hopper fit test
(tests/test_kernels_hopper.py) and the instruction count of benchmarks/mixit_sass.py use these.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from .mixit_triton import ARG_TYPES, Tiles

HOPPER = ("cuda", 90, 32)  # GPUTarget(backend, compute capability, warp size)


def tools_dir() -> Path:
    """Triton's bundled CUDA tools (ptxas, nvdisasm, cuobjdump)."""
    import triton  # deferred: optional (GPU kernels)

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def missing() -> str | None:
    """Why kernels cannot be compiled and assembled here, or None."""
    try:
        import triton  # deferred: optional (GPU kernels)
    except ImportError:
        return "Triton is not installed"
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        return "this Triton has no CUDA backend (triton.backends lacks 'nvidia')"
    if not any((tools_dir() / name).is_file() for name in ("ptxas-blackwell", "ptxas")):
        return "Triton's bundled ptxas is absent (backends/nvidia/bin)"
    return None


def compile_ptx(fn, constexprs: dict, tile: Tiles, arg_types: dict[str, str] = ARG_TYPES) -> tuple[int, str]:
    """(shared memory bytes, PTX) of one kernel specialisation compiled for sm_90; `arg_types` maps the
    kernel's arguments to Triton types (default: the regenerating kernels', mixit_triton.ARG_TYPES), `tile`
    gives num_warps and num_stages."""
    import triton  # deferred: optional (GPU kernels)
    from triton.backends.compiler import GPUTarget  # deferred: optional (GPU kernels)
    from triton.compiler import ASTSource  # deferred: optional (GPU kernels)

    signature = {a: "constexpr" if a in constexprs else arg_types[a] for a in fn.arg_names}
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs=constexprs),
        target=GPUTarget(*HOPPER),
        options={"num_warps": tile.num_warps, "num_stages": tile.num_stages},
    )
    return kernel.metadata.shared, kernel.asm["ptx"]


def assemble(ptx: str, workdir: Path) -> tuple[Path | None, str]:
    """(cubin, ptxas -v log) from the first bundled ptxas that accepts the PTX (Triton 3.9's CUDA 12.9
    `ptxas` rejects the PTX 9.4 it emits; `ptxas-blackwell`, CUDA 13.x, assembles it); (None, the
    errors) when none does."""
    arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)
    src, cubin = workdir / "kernel.ptx", workdir / "kernel.cubin"
    src.write_text(ptx)
    errors = []
    for name in ("ptxas-blackwell", "ptxas"):
        ptxas = tools_dir() / name
        if not ptxas.is_file():
            continue
        out = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name={arch}", str(src), "-o", str(cubin)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode == 0:
            return cubin, out.stderr + out.stdout
        errors.append(f"{name}: {out.stderr.strip()[-400:]}")
    return None, "\n".join(errors)


def disassemble(cubin: Path) -> str:
    """The machine code (SASS) of a cubin, as nvdisasm prints it."""
    out = subprocess.run([str(tools_dir() / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, timeout=300)
    out.check_returncode()
    return out.stdout
