"""Every Triton kernel of the project compiles for Hopper (sm_90) on this CPU machine and fits an H100.

Triton compiles without a GPU given a CUDA target; the ptxas that ships with Triton assembles the
PTX and, with -v, prints registers and spill bytes. Each tile the launcher picks (mixit_triton.tiles)
for the head dims and block sizes of the presets and of the tests is compiled, forward and backward,
and must use at most the H100's 232,448 B of shared memory per block and spill no registers, so the
first lent GPU does not meet a kernel that cannot launch. The regenerating kernels only ever see
float32 tensors (the autograd function upcasts bf16/fp16 inputs), so float32 is the one dtype compiled
for them; the streamed path's kernels (mixit_streamed.py) take the model's dtype, so they are compiled
in bf16 and float32 at every preset head dim.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from model.config import PRESETS, preset
from model.kernels import hopper_aot, mixit_streamed, mixit_triton
from model.kernels.mixit_triton import tiles

H100_SHARED_PER_BLOCK = 232_448  # bytes, opt-in maximum per thread block (compute capability 9.0)
MAX_REGISTERS = 255

# (head dim, mixit_block_size) the kernels launch with: every preset at its own block size, the
# GPU parity tests (head dim 64 at block 64; tiny's head dim 16 at the default block) and the
# interpreter test (head dim 16 at block 16).
LAUNCHES = sorted(
    {(preset(name).head_dim, preset(name).mixit_block_size) for name in PRESETS} | {(64, 64), (16, 128), (16, 16)}
)
TILES = sorted({tiles(dh, block) for dh, block in LAUNCHES})
# The streamed kernels' launches: every preset head dim, in each dtype, at one sequence a program and at
# the widest group the launcher makes (mixit_streamed.launch at a batch of 64).
STREAMED = sorted(
    {
        (dt, mixit_streamed.launch(preset(name).head_dim, b))
        for name in PRESETS
        for b in (1, 64)
        for dt in ("bf16", "fp32")
    }
)


@pytest.fixture(scope="module")
def hopper():
    """(compile one kernel for sm_90, assemble PTX with -v) or a skip naming what is absent."""
    pytest.importorskip("triton")
    why = hopper_aot.missing()
    if why:
        pytest.skip(why)

    def assemble(ptx: str, tmp: Path) -> str:
        cubin, log = hopper_aot.assemble(ptx, tmp)
        if cubin is None:
            pytest.fail("no bundled ptxas assembles the PTX:\n" + log)
        return log

    return hopper_aot.compile_ptx, assemble


def _usage(log: str) -> tuple[int, int, int]:
    """(registers, spill-store bytes, spill-load bytes) from `ptxas -v`."""
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    stores = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    loads = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", log))
    return regs, stores, loads


def _variants(tile) -> list[tuple[str, dict]]:
    """Forward and backward at the causal, identity-term default, with each generator (mixit_rng);
    every causal/identity combination at the widest head dim (the largest register and
    shared-memory footprint)."""
    widest = tile.BD == max(t.BD for t in TILES) and tile.BM == max(t.BM for t in TILES)
    fwd = [(True, True), (False, True), (True, False), (False, False)] if widest else [(True, True)]
    bwd = [True, False] if widest else [True]
    out = []
    for four in (False, True):
        out += [("fwd", dict(IDENT=ident, CAUSAL=causal, RNG4X=four)) for causal, ident in fwd]
        out += [("bwd", dict(CAUSAL=causal, RNG4X=four)) for causal in bwd]
    return out


def test_launches_cover_the_gpu_head_dims():
    """The 1b preset (head dim 64) and the 3b/8b presets (head dim 128) are among the compiled tiles."""
    assert {preset("1b").head_dim, preset("3b").head_dim, preset("8b").head_dim} == {64, 128}
    assert {t.BD for t in TILES} >= {64, 128}
    assert all(t.BM <= mixit_triton.MAX_TILE and t.BN <= mixit_triton.MAX_TILE for t in TILES)


@pytest.mark.parametrize("tile", TILES, ids=[f"dh{t.BD}_tile{t.BM}x{t.BN}_w{t.num_warps}" for t in TILES])
def test_mixit_kernels_fit_an_h100(hopper, tile, tmp_path):
    compile_, assemble = hopper
    fwd, bwd = mixit_triton._kernels()[:2]
    problems = []
    for direction, flags in _variants(tile):
        constexprs = dict(DH=tile.BD, BM=tile.BM, BN=tile.BN, BD=tile.BD, SWEEP_N=0, **flags)
        shared, ptx = compile_(fwd if direction == "fwd" else bwd, constexprs, tile)
        regs, stores, loads = _usage(assemble(ptx, tmp_path))
        where = f"{direction} {flags} {tile}"
        if shared > H100_SHARED_PER_BLOCK:
            problems.append(f"{where}: {shared} B shared memory > {H100_SHARED_PER_BLOCK}")
        if regs > MAX_REGISTERS or stores or loads:
            problems.append(f"{where}: {regs} registers, spills {stores} B stored / {loads} B loaded")
    assert not problems, "\n".join(problems)


def _check_fit(compile_, assemble, tmp_path, fn, constexprs, launch, arg_types) -> list[str]:
    shared, ptx = compile_(fn, constexprs, launch, arg_types)
    regs, stores, loads = _usage(assemble(ptx, tmp_path))
    where = f"{fn.__name__} {constexprs} {launch}"
    problems = []
    if shared > H100_SHARED_PER_BLOCK:
        problems.append(f"{where}: {shared} B shared memory > {H100_SHARED_PER_BLOCK}")
    if regs > MAX_REGISTERS or stores or loads:
        problems.append(f"{where}: {regs} registers, spills {stores} B stored / {loads} B loaded")
    return problems


def test_streamed_launches_cover_the_presets():
    """Every preset head dim (16 to 128) in bf16 and float32; the widest group at MAX_WIDTH columns."""
    assert {lc.BD for _, lc in STREAMED} == {preset(name).head_dim for name in PRESETS} == {16, 32, 64, 128}
    assert max(lc.BD * lc.SEQS for _, lc in STREAMED) == mixit_streamed.MAX_WIDTH


@pytest.mark.parametrize("dtype, launch", STREAMED, ids=[f"{dt}_dh{lc.BD}_seqs{lc.SEQS}" for dt, lc in STREAMED])
def test_streamed_kernels_fit_an_h100(hopper, dtype, launch, tmp_path):
    """The streamed forward and backward at the causal, identity-term default; every causal/identity
    combination at the largest head dim; the tile generator (causal or not, each generator) once per dtype.
    Four heads a V head (GQA: preset 1b's and 8b's): the backward's loop over them."""
    compile_, assemble = hopper
    _, fwd, bwd = mixit_streamed._kernels()
    types = mixit_streamed.arg_types(dtype)
    base = dict(DH=launch.BD, GROUPS=4, BT=mixit_streamed.TILE, BD=launch.BD, SEQS=launch.SEQS, SWEEP_N=0, UPCAST=False)
    largest = launch.BD == max(lc.BD for _, lc in STREAMED)
    flags = [(True, True), (False, True), (True, False), (False, False)] if largest else [(True, True)]
    problems = []
    for causal, ident in flags:
        for fn in (fwd, bwd):
            constexprs = dict(base, CAUSAL=causal, IDENT=ident)
            problems += _check_fit(compile_, assemble, tmp_path, fn, constexprs, launch, types)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_streamed_tile_generator_fits_an_h100(hopper, dtype, tmp_path):
    compile_, assemble = hopper
    gen = mixit_streamed._kernels()[0]
    launch = types.SimpleNamespace(**mixit_streamed.GENERATE)  # generate_tiles' warps and stages
    problems = []
    for causal in (True, False):
        for four in (False, True):
            constexprs = dict(CAUSAL=causal, BT=mixit_streamed.TILE, RNG4X=four)
            problems += _check_fit(
                compile_, assemble, tmp_path, gen, constexprs, launch, mixit_streamed.arg_types(dtype)
            )
    assert not problems, "\n".join(problems)


def test_mixit_loops_use_the_tensor_cores_and_the_issue_count_is_reported(hopper, tmp_path):
    """benchmarks/mixit_sass.py: each kernel's main loop holds Hopper matrix instructions (HGMMA), and
    the report gives its instruction mix and issue time."""
    out = tmp_path / "sass.txt"
    run = subprocess.run(
        [sys.executable, "benchmarks/mixit_sass.py", "--preset", "1b", "--seq", "1024", "--out", str(out)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [
        line.split("|")[1:-1]
        for line in out.read_text().splitlines()
        if line.startswith("| forward") or line.startswith("| backward")
    ]
    assert [r[0].strip() for r in rows] == ["forward", "backward"]
    for r in rows:
        loop, hgmma, issue_ms = int(r[1]), int(r[2]), float(r[7])
        assert hgmma >= 1 and loop > hgmma and issue_ms > 0, r
