"""What the MixiT Triton kernels issue per tile, read from their Hopper machine code (no GPU needed).

Both kernels walk 64 x 64 (BM x BN) tiles of the mixing matrix and regenerate each tile with
Philox and Box-Muller (`tl.randn`) before one tensor-core product with the values. This compiles
the forward and backward kernels for sm_90 at a preset's tile (model/kernels/hopper_aot.py),
disassembles them, finds each kernel's main loop (the longest backward branch) and counts its
instructions by opcode: how many are matrix instructions (HGMMA) and how many make random numbers.
From that count, the tiles of one training step and the chip's issue rate (one warp instruction per
scheduler per cycle) it estimates the time a training step's mixing needs only to issue those loops.

    python benchmarks/mixit_sass.py --preset 1b --seq 8192 --batch 1 --out docs/data/gpu/mixit_sass_1b_T8192.txt
    python benchmarks/mixit_sass.py --preset 1b --seq 8192 --batch 1 --rng philox4x \
        --out docs/data/gpu/mixit_sass_1b_T8192_philox4x.txt

`--rng philox4x` counts the kernels that draw four matrix entries per Philox call (`tl.randn4x`,
the model's `mixit_rng: philox4x`).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from model.config import MIXIT_RNGS, preset  # noqa: E402
from model.kernels import hopper_aot, mixit_triton  # noqa: E402

# H100 / H200 SXM (leads from the data sheet, the same for both): multiprocessors, schedulers per
# multiprocessor (each issues one warp instruction a cycle), boost clock
SMS, SCHEDULERS, CLOCK_HZ = 132, 4, 1.98e9


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a branch back to an earlier label) of one kernel."""
    labels, order, pending = {}, [], None
    for line in sass.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", line):
            pending = m.group(1)
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line):
            addr = int(m.group(1), 16)
            if pending:
                labels[pending], pending = addr, None
            order.append((addr, m.group(2)))
    loops = []
    for addr, text in order:
        if (m := re.search(r"BRA\s+`\(\.(L_x_\d+)\)", text)) and labels.get(m.group(1), addr) < addr:
            loops.append((labels[m.group(1)], addr))
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [text for addr, text in order if start <= addr <= end]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rng", default="philox", choices=MIXIT_RNGS, help="the model's mixit_rng")
    ap.add_argument("--out", default=None, help="also write the report here")
    args = ap.parse_args()
    if why := hopper_aot.missing():
        print(f"error: cannot compile for Hopper here: {why}. Fix: pip install triton (Linux x86_64)", file=sys.stderr)
        return 2
    cfg = preset(args.preset)
    tile = mixit_triton.tiles(cfg.head_dim, cfg.mixit_block_size)
    fwd, bwd = mixit_triton._kernels()[:2]
    import triton  # deferred: optional (GPU kernels)

    rows = args.seq // tile.BM
    tiles = rows * (rows + 1) // 2 * (cfg.num_heads - 1) * cfg.num_layers * args.batch  # causal: j <= i
    lines = [
        f"MixiT Triton kernels, preset {args.preset} (head dim {cfg.head_dim}, {cfg.num_heads} heads, "
        f"{cfg.num_layers} layers), T {args.seq}, batch {args.batch}, causal, mixit_rng {args.rng}; Triton "
        f"{triton.__version__}, sm_90; tile {tile.BM}x{tile.BN}, {tile.num_warps} warps",
        f"tiles per pass (heads 1..H-1, every layer): {tiles:,}",
        "",
        "| kernel | loop instructions | HGMMA | MUFU | integer (IMAD, LOP3, SHF, IADD3, LEA) | float (FFMA, FMUL, FADD) "
        "| warp instructions per pass | issue time per pass (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    issue_total_ms = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn, flags in (("forward", fwd, dict(IDENT=True, CAUSAL=True)), ("backward", bwd, dict(CAUSAL=True))):
            constexprs = dict(
                DH=tile.BD, BM=tile.BM, BN=tile.BN, BD=tile.BD, SWEEP_N=0, RNG4X=args.rng == "philox4x", **flags
            )
            _, ptx = hopper_aot.compile_ptx(fn, constexprs, tile)
            cubin, log = hopper_aot.assemble(ptx, Path(tmp))
            if cubin is None:
                print(
                    f"error: no bundled ptxas assembles the kernel: {log}. Fix: a Triton with CUDA 13 tools",
                    file=sys.stderr,
                )
                return 2
            loop = main_loop(hopper_aot.disassemble(cubin))
            ops = collections.Counter(opcode(t) for t in loop)
            integer = sum(ops[k] for k in ("IMAD", "LOP3", "SHF", "IADD3", "LEA", "VIADD"))
            floating = sum(ops[k] for k in ("FFMA", "FMUL", "FADD"))
            warp_instr = len(loop) * tile.num_warps * tiles
            issue_ms = warp_instr / (SMS * SCHEDULERS * CLOCK_HZ) * 1e3
            issue_total_ms += issue_ms
            lines.append(
                f"| {name} | {len(loop)} | {ops['HGMMA']} | {ops['MUFU']} | {integer} | {floating} "
                f"| {warp_instr:.3g} | {issue_ms:.0f} |"
            )
    lines += [
        "",
        f"forward + backward: {issue_total_ms:.0f} ms per step only to issue the loops ({SMS} SMs x {SCHEDULERS} schedulers, "
        f"one warp instruction each a cycle at {CLOCK_HZ / 1e9:.2f} GHz). An estimate: the loop's static count, once per "
        "tile and warp; it includes sin/cos's slow path for huge arguments, which Box-Muller's angles in [0, 2 pi) "
        "never take, so the common path issues somewhat fewer.",
    ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
