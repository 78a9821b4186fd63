"""Training-step throughput of every variant, side by side with HuggingFace Llama at the identical
config: tokens/s, TFLOP/s, MFU against the measured matmul peak and against the data sheet's dense
bf16 peak, and peak memory (the method: docs/PERFORMANCE.md, Benchmark).

A shape is either a preset, `--preset NAME [--seq T ...]`: exactly `model.preset(NAME)` at length T
(the trainer's model for that preset, variant per entry), or a custom `--sizes LAYERSxWIDTHxSEQ`,
labelled custom in the output: preset `s`'s settings at that depth and width with heads = width/64,
as many KV heads as heads and the MLP from 8d/3, which no preset has (at 16x2048 it is not `1b`).

Each entry lives in its own worker process, so no entry pays for another's memory (on CPU, large
allocations cost page faults that depend on what else the process holds); timed rounds alternate
between the workers, one active at a time, so that drift in machine speed hits each alike.

    python benchmarks/bench_model.py                          # the CPU table of docs/PERFORMANCE.md
    python benchmarks/bench_model.py --mixit-memory 1024 2048 4096
    python benchmarks/bench_model.py --device cuda --dtype bf16 --preset 1b --seq 2048 --batch 4 --no-hf \
        --variants standard frozen_qk mixit mixit_triton trainer
    python benchmarks/bench_model.py --variants standard mixit --no-hf --profile 15   # where a step's time goes
    python benchmarks/bench_model.py --device cuda --dtype bf16 --preset 1b --dry-run  # the plan, nothing timed
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from common.cli import CliParser, run_cli  # noqa: E402
from common.errors import UserError  # noqa: E402
from model import PRESETS, ModelConfig, preset  # noqa: E402
from model.flops import flops_per_token  # noqa: E402
from model.hf_format import llama_config_fields  # noqa: E402
from model.layers import MixingAttention  # noqa: E402
from model.mfu import measure_matmul_tflops, mfu, table_peak_tflops  # noqa: E402
from model.transformer import build_model
from pretrain.config import load_recipe  # noqa: E402
from pretrain.distributed import SOLO_ENV, init_distributed, pick_device, shutdown_distributed  # noqa: E402
from pretrain.engine import ModelEngine  # noqa: E402
from pretrain.layout import plan_layout  # noqa: E402
from pretrain.task_model import model_config  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANT_NAMES = ["standard", "frozen_qk", "frozen_mlp", "mixit", "random_transformer"]
# more entries by name: MixiT on one path whatever the memory rule of model/kernels/select.py picks
# (mixit_dense: the cached matrix; mixit_triton: the regenerating kernel; mixit_streamed: the stored
# tiles), and the kernel drawing M four entries per Philox call (mixit_philox4x)
NAMED_KINDS = {
    "mixit_dense": ("mixit", {"mixit_impl": "dense"}),
    "mixit_triton": ("mixit", {"mixit_impl": "triton"}),
    "mixit_streamed": ("mixit", {"mixit_impl": "streamed"}),
    "mixit_philox4x": ("mixit", {"mixit_impl": "triton", "mixit_rng": "philox4x"}),
}
# The trainer's own step on the standard model: pretrain.engine.ModelEngine built from this recipe (the
# 1b recipe: DeepSpeed ZeRO-1, activation checkpointing, bf16 with fp32 master weights), at the
# benchmark's preset, length and batch, in micro-batches of at most the recipe's.
TRAINER = "trainer"
TRAINER_RECIPE = "recipes/1b_gpu_zero1.yaml"
KINDS = [*VARIANT_NAMES, *NAMED_KINDS, TRAINER, "hf_llama"]
CUSTOM_VOCAB = 32000


def parse_size(s: str) -> tuple[int, int, int]:
    try:
        layers, width, seq = (int(x) for x in s.split("x"))
    except ValueError:
        raise UserError(f"--sizes {s}: not LAYERSxWIDTHxSEQ. Fix: e.g. --sizes 4x256x256") from None
    return layers, width, seq


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def shapes_of(args) -> list[str]:
    """The shapes to time: 'NAME@T' for a preset at length T, 'LAYERSxWIDTHxSEQ' for a custom shape."""
    if args.preset:
        seqs = args.seq or [preset(args.preset).max_seq_len]
        return [f"{args.preset}@{t}" for t in seqs]
    return args.sizes


def entry_config(args, shape: str, kind: str, **over) -> ModelConfig:
    """The model an entry times: at a preset shape exactly `model.preset(NAME)` at length T (the
    variant, the named MixiT settings and compile_blocks per entry); at a custom shape preset `s`'s
    settings at that depth and width."""
    variant, named = NAMED_KINDS.get(kind, ("standard" if kind in ("hf_llama", TRAINER) else kind, {}))
    common = dict(variant=variant, compile_blocks=args.compile, **named, **over)
    if "@" in shape:
        name, seq = shape.split("@")
        return preset(name, max_seq_len=int(seq), **common)
    layers, width, seq = parse_size(shape)
    heads = max(1, width // 64)
    return preset(
        "s",
        hidden_size=width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        intermediate_size=None,
        vocab_size=args.vocab or CUSTOM_VOCAB,
        max_seq_len=seq,
        **common,
    )


def describe_shape(shape: str, cfg: ModelConfig) -> str:
    """The shape's label: which model the numbers belong to (a custom shape says it is one)."""
    dims = (
        f"{cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, "
        f"MLP {cfg.intermediate_size}, vocab {cfg.vocab_size}, {'tied' if cfg.tie_embeddings else 'untied'} embeddings"
    )
    if "@" in shape:
        name, seq = shape.split("@")
        return f"preset {name}, T {seq}: model.preset({name!r}, max_seq_len={seq}) = {dims}"
    return f"custom {shape} (layers x width x seq; not a preset: heads = width/64) = {dims}"


def mixit_path(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """The path MixiT's mixing takes for this model here: the model's own layer decides (its rule is
    model/kernels/select.py's), built on the meta device; None where it cannot be known here (the
    CUDA rule needs the GPU's memory)."""
    if cfg.variant != "mixit":
        return None
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    with torch.device("meta"):
        paths = [MixingAttention(cfg, i).impl(device, dtype) for i in range(cfg.num_layers)]
    return layer_ranges(paths)


def layer_ranges(paths: list[str]) -> str:
    """One path, or each path with its layers where they differ (the tiles chunked by layer):
    'streamed (layers 0-7), triton (layers 8-15)'."""
    if len(set(paths)) == 1:
        return paths[0]
    runs = []
    for i, path in enumerate(paths):
        if runs and runs[-1][0] == path:
            runs[-1][2] = i
        else:
            runs.append([path, i, i])
    return ", ".join(f"{path} (layers {a}-{b})" if a != b else f"{path} (layer {a})" for path, a, b in runs)


def distinct_kinds(args, shape: str, kinds: list[str]) -> tuple[list[str], list[str]]:
    """(the entries to time, a note for each dropped one): an entry that would time the same model on
    the same path as one before it is dropped (where the memory rule already puts `mixit` on the Triton
    kernel, `mixit_triton` would time it twice)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    seen: list[tuple[ModelConfig, str]] = []
    keep, notes = [], []
    for kind in kinds:
        if kind in ("hf_llama", TRAINER):
            keep.append(kind)
            continue
        cfg = entry_config(args, shape, kind)
        path = mixit_path(cfg, device, dtype)
        key = cfg.replace(mixit_impl=path) if path else cfg
        same = next((k for c, k in seen if c == key), None)
        if same is not None:
            notes.append(f"{kind}: not timed, the same model on the same path ({path}) as {same} here")
            continue
        seen.append((key, kind))
        keep.append(kind)
    return keep, notes


def trainer_config(args, shape: str):
    """(RunConfig, the trainer's ModelConfig) of the trainer entry: TRAINER_RECIPE at this preset, length,
    precision and batch (micro-batches of at most the recipe's), on one device."""
    if "@" not in shape:
        raise UserError(f"the {TRAINER} entry trains a preset, and {shape} is a custom shape. Fix: --preset NAME")
    name, seq = shape.split("@")
    batch = args.batch
    micro = math.gcd(batch, load_recipe(TRAINER_RECIPE).train.micro_batch_sequences)
    over = [
        f"model.preset={name}",
        "model.variant=standard",
        f"model.compile_blocks={str(args.compile).lower()}",
        f"train.seq_len={seq}",
        f"train.device={torch.device(args.device).type}",
        f"train.precision={args.dtype}",
        "train.max_tokens=null",
        "train.max_steps=1000000",
        f"train.global_batch_tokens={batch * int(seq)}",
        f"train.micro_batch_sequences={micro}",
    ]
    cfg = load_recipe(TRAINER_RECIPE, over)
    mcfg = model_config(cfg, None)
    if mcfg != entry_config(args, shape, TRAINER):
        raise UserError(f"{TRAINER_RECIPE} at {shape} trains another model than the benchmark's standard entry")
    return cfg, mcfg


class Entry:
    """One thing to time: our model in a variant, the trainer's own step, or the HF reference."""

    def __init__(self, args, shape: str, kind: str, **over):
        self.kind, self.note = kind, ""
        self.device, self.dtype = torch.device(args.device), DTYPES[args.dtype]
        self.cfg = entry_config(args, shape, kind, **over)
        seq, vocab = self.cfg.max_seq_len, self.cfg.vocab_size
        torch.manual_seed(0)
        self.engine = None
        if kind == TRAINER:
            self._build_trainer(args, shape)
        elif kind == "hf_llama":
            from transformers import LlamaConfig, LlamaForCausalLM  # deferred: heavy, only the HF reference

            hf_cfg = LlamaConfig(**llama_config_fields(self.cfg.replace(compile_blocks=False)))
            hf_cfg._attn_implementation = "sdpa"
            self.model = LlamaForCausalLM(hf_cfg).to(self.device, self.dtype).train()
            if args.compile:
                for layer in self.model.model.layers:
                    layer.compile()
        else:
            self.model = build_model(self.cfg, seed=0, device=self.device).to(self.dtype).train()
            self.note = mixit_path(self.cfg, self.device, self.dtype) or ""
        if self.engine is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            # ours: the trainer's optimizer (torch AdamW, fused kernel: pretrain/layout.py), unless
            # --plain-adamw; the HF reference: a plain AdamW loop, as a HF user would write it
            self.opt = torch.optim.AdamW(params, lr=1e-4, fused=kind != "hf_llama" and not args.plain_adamw)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, vocab, (args.batch, seq + 1), generator=g).to(self.device)
        self.tokens = args.batch * seq
        self.flops = flops_per_token(self.cfg, seq)["train"] * self.tokens

    def _build_trainer(self, args, shape: str) -> None:
        """The trainer's engine in this process, alone in a process group of one."""
        cfg, mcfg = trainer_config(args, shape)
        os.environ.update(SOLO_ENV)
        self.device = pick_device(self.device.type)
        init_distributed(self.device)
        layout = plan_layout(cfg, 1)
        self.engine = ModelEngine(cfg, mcfg, layout, self.device)
        self.engine.build(0)
        self.model = self.engine.model
        ckpt = f"{self.engine.checkpointing} ({self.engine.checkpointing_reason})"
        self.note = f"{TRAINER_RECIPE}: {layout.describe()}; activation checkpointing {ckpt}; {cfg.train.precision}"

    def step(self):
        inp, lab = self.x[:, :-1], self.x[:, 1:]
        if self.engine is not None:
            self.engine.train_step({"input_ids": inp, "labels": lab})
            return
        if self.kind == "hf_llama":
            # HF shifts labels itself: give it the same t tokens and t scored targets
            logits = self.model(input_ids=inp).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), lab.flatten())
        else:
            loss = self.model(inp, labels=lab)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def warm_up(self, measure: bool = True) -> float | None:
        """Two steps (compiling, where asked) from the freshly built entry; with `measure`, their peak
        memory in MiB (CUDA: allocated; CPU: the process's peak RSS since the build)."""
        if measure:
            try:  # reset the peak RSS
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            self.step()
        sync(self.device)
        if not measure:
            return None
        return torch.cuda.max_memory_allocated() / 2**20 if self.device.type == "cuda" else _vm_hwm_mib()

    def timed(self, steps: int) -> float:
        """Seconds per step over `steps` steps."""
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync(self.device)
        return (time.perf_counter() - t0) / steps

    def profile(self, top: int) -> str:
        """One step under torch.profiler: the `top` operators by self time on the device (CUDA
        kernels on a GPU, operators on a CPU), as torch's table."""
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            self.step()
            sync(self.device)
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        return prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60)

    def close(self) -> None:
        if self.engine is not None:
            shutdown_distributed()


def _worker_main(conn, args, shape: str, kind: str):
    """Build one entry and warm it up (its peak memory measured over the two warm-up steps, in this
    process that holds nothing else), then time `steps` steps (or profile one) whenever asked. Every
    entry stays resident but only one runs at a time, so each hands its cached device memory back
    before it replies: the entries' activations need not fit side by side."""
    e = Entry(args, shape, kind)
    peak = e.warm_up(measure=not args.no_memory)
    release = torch.cuda.empty_cache if e.device.type == "cuda" else (lambda: None)
    release()
    conn.send((e.tokens, e.flops, peak, e.note))
    while (msg := conn.recv()) is not None:
        reply = e.profile(msg[1]) if isinstance(msg, tuple) else e.timed(msg)  # ("profile", top) or steps
        release()
        conn.send(reply)
    e.close()


class Worker:
    """An Entry in its own process; the parent only asks it to run timed rounds."""

    def __init__(self, args, shape: str, kind: str):
        self.kind = kind
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, args, shape, kind), daemon=True)
        self.proc.start()
        self.tokens, self.flops, self.peak_mib, self.note = self._recv()
        self.times: list[float] = []

    def _recv(self):
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"benchmark worker for {self.kind} died (exit code {self.proc.exitcode})")
        return self.conn.recv()

    def timed(self, steps: int):
        self.conn.send(steps)
        self.times.append(self._recv())

    def profile(self, top: int) -> str:
        self.conn.send(("profile", top))
        return self._recv()

    def close(self):
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def memory_of(args, size: str, kind: str, extra: list[str]) -> float:
    """Peak memory (MiB) of a few training steps of one entry, in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory-child", kind, "--sizes", size, "--dtype", args.dtype]
    cmd += ["--vocab", str(args.vocab or CUSTOM_VOCAB), "--batch", str(args.batch), "--device", args.device]
    cmd += [flag for flag, on in (("--compile", args.compile), ("--plain-adamw", args.plain_adamw)) if on] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def _vm_hwm_mib() -> float:
    """Peak resident memory of this process since the last reset (Linux), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_child(args):
    over = {"mixit_impl": args.mixit_impl} if args.mixit_impl else {}
    e = Entry(args, args.sizes[0], args._memory_child, **over)
    print(json.dumps({"peak_mib": e.warm_up()}))


def mixit_memory_table(args):
    print(
        f"\nMixiT memory vs T (custom: 1 layer of width {args.mixit_width}, batch 1, {args.dtype}, one fwd+bwd step; "
        f"peak {'CUDA allocated' if args.device == 'cuda' else 'process RSS'} in MiB)"
    )
    print(f"{'T':>6} {'impl':>8} {'peak MiB':>10} {'H*T^2*4B per layer (MiB)':>26}")
    for T in args.mixit_memory:
        heads = max(1, args.mixit_width // 64)
        for impl in args.mixit_impls:
            a = argparse.Namespace(**{**vars(args), "batch": 1})
            mib = memory_of(a, f"1x{args.mixit_width}x{T}", "mixit", ["--mixit-impl", impl])
            print(f"{T:>6} {impl:>8} {mib:>10.0f} {heads * T * T * 4 / 2**20:>26.0f}", flush=True)


def sheet_peak(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(the data sheet's dense bf16 peak, its source) for this device: model/mfu.py's table by the GPU's
    name; none for a CPU or an fp32 run (the table holds bf16 figures)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None, "none: the table holds dense bf16 figures of GPUs"
    return table_peak_tflops(torch.cuda.get_device_name(device))


def peak_lines(measured: float, sheet: float | None, sheet_source: str, dtype: str) -> str:
    """The two peaks every MFU of the table is taken against."""
    if sheet:
        sheet_text = f"{sheet:.1f} TFLOP/s ({sheet_source}: the data sheet's dense bf16, model/mfu.py PEAK_TFLOPS)"
    else:
        sheet_text = f"unknown ({sheet_source})"
    return (
        f"MFU peak, measured: {measured:.3f} TFLOP/s ({dtype} square matmul, best over rounds; model/mfu.py)\n"
        f"MFU peak, data sheet: {sheet_text}"
    )


def percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


HEADER = (
    f"{'model':<20} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'sheet':>6} {'GFLOP/tok':>9} {'peak MiB':>9} "
    f"{'vs std':>7} {'vs HF':>7}  path"
)


def table_row(
    kind: str, tokens: int, flops: float, seconds: float, peaks: tuple[float, float | None], mem: str, vs: tuple, note
) -> str:
    """One entry's line: tok/s, TFLOP/s, MFU against the measured peak, then against the data sheet's."""
    tf = flops / seconds / 1e12
    measured, sheet = peaks
    return (
        f"{kind:<20} {tokens / seconds:>9.0f} {tf:>8.4f} {percent(mfu(tf, measured)):>6} "
        f"{percent(mfu(tf, sheet)):>6} {flops / tokens / 1e9:>9.4f} {mem:>9} {vs[0]:>7} {vs[1]:>7}  {note}"
    )


def causal_line(args, shape: str, entries, median: dict, peaks: tuple[float, float | None]) -> str:
    """The MFU of each entry with attention's causal half only (model/flops.py causal_half), beside the
    table's, which counts the whole T x T square (the convention, torchtitan's too)."""
    measured, sheet = peaks
    parts = []
    for e in entries:
        cfg = entry_config(args, shape, e.kind)
        full, half = (flops_per_token(cfg, cfg.max_seq_len, causal_half=c)["train"] for c in (False, True))
        tf = e.flops * half / full / median[e.kind] / 1e12
        parts.append(
            f"{e.kind} {percent(mfu(tf, measured))}" + (f" (sheet {percent(mfu(tf, sheet))})" if sheet else "")
        )
    return "MFU of attention's causal half (the table counts the whole square): " + ", ".join(parts)


def check_args(args) -> None:
    """Refuse combinations that would time something else than was asked for."""
    if args.preset:
        if args.sizes:
            raise UserError("--preset and --sizes name two shapes. Fix: one of them (--seq sets the preset's length)")
        if args.vocab:
            raise UserError(f"--vocab would change preset {args.preset}'s vocabulary. Fix: drop --vocab, or --sizes")
        preset(args.preset)  # an unknown name: one error line naming the presets
    else:
        if args.seq:
            raise UserError("--seq sets a preset's length. Fix: --preset NAME, or the T of --sizes LAYERSxWIDTHxSEQ")
        args.sizes = args.sizes or ["4x256x256"]
    unknown = [k for k in args.variants if k not in KINDS]
    if unknown:
        raise UserError(f"--variants: unknown entry {unknown[0]!r}. Fix: choose from {KINDS}")
    for shape in shapes_of(args):
        for kind in args.variants:
            entry_config(args, shape, kind)
            if kind == TRAINER:
                trainer_config(args, shape)


def dry_run(args) -> None:
    """What a run would time, each shape labelled, nothing built or timed (cheap, and on any machine)."""
    for shape in shapes_of(args) if args.variants else []:
        kinds, dropped = distinct_kinds(args, shape, list(args.variants) + ([] if args.no_hf else ["hf_llama"]))
        print(f"\nshape: {describe_shape(shape, entry_config(args, shape, 'standard'))}")
        for kind in kinds:
            cfg = entry_config(args, shape, kind)
            path = mixit_path(cfg, torch.device(args.device), DTYPES[args.dtype])
            where = (
                f", MixiT path {path}"
                if path
                else (", MixiT path: the device decides" if cfg.variant == "mixit" else "")
            )
            note = f"; {TRAINER_RECIPE} on one device" if kind == TRAINER else ""
            print(f"  {kind}: {flops_per_token(cfg, cfg.max_seq_len)['train'] / 1e9:.4f} GFLOP/token{where}{note}")
        for note in dropped:
            print(f"  {note}")
    if args.mixit_memory:
        print(
            f"MixiT memory table: T {' '.join(map(str, args.mixit_memory))} x {' '.join(args.mixit_impls)} "
            f"(custom: 1 layer of width {args.mixit_width}, batch 1)"
        )
    print("dry run: nothing built or timed")


def build_parser() -> CliParser:
    ap = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help=f"time exactly model.preset(NAME), one of {list(PRESETS)}")
    ap.add_argument("--seq", type=int, nargs="+", default=None, help="the preset's lengths T (default its own)")
    ap.add_argument("--sizes", nargs="+", default=None, help="custom LAYERSxWIDTHxSEQ (heads = width/64; not a preset)")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=VARIANT_NAMES,
        help=f"none: only the MixiT memory table; also {[*NAMED_KINDS, TRAINER]}",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the HuggingFace reference")
    ap.add_argument("--vocab", type=int, default=None, help=f"custom shapes' vocabulary (default {CUSTOM_VOCAB})")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks (ours and HF's)")
    ap.add_argument(
        "--plain-adamw",
        action="store_true",
        help="give our entries HF's plain AdamW too (isolates the model from the optimizer)",
    )
    ap.add_argument("--no-memory", action="store_true", help="no peak-memory column")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, one profiled step per entry: its N costliest operators",
    )
    ap.add_argument("--peak-n", type=int, default=0, help="matmul size for the peak (default 2048 CPU, 8192 GPU)")
    ap.add_argument("--mixit-memory", type=int, nargs="*", default=[], help="T values for the MixiT memory table")
    ap.add_argument("--mixit-impls", nargs="+", default=["dense", "blocked"])
    ap.add_argument("--mixit-width", type=int, default=256)
    ap.add_argument("--dry-run", action="store_true", help="print the shapes and entries a run would time; time none")
    ap.add_argument("--mixit-impl", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_memory-child", default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args._memory_child:
        return memory_child(args)
    check_args(args)

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    print(
        f"device={device} ({torch.get_num_threads()} threads) dtype={args.dtype} compile={args.compile} "
        f"batch={args.batch} torch={torch.__version__}"
    )
    if args.dry_run:
        return dry_run(args)
    peak_n = args.peak_n or (8192 if device.type == "cuda" else 2048)
    peak = measure_matmul_tflops(device, dtype, peak_n) if args.variants else 0.0
    sheet, sheet_source = sheet_peak(device, dtype)
    for shape in shapes_of(args) if args.variants else []:
        kinds, dropped = distinct_kinds(args, shape, list(args.variants) + ([] if args.no_hf else ["hf_llama"]))
        entries = [Worker(args, shape, k) for k in kinds]  # built and warmed up (compiled) one by one
        try:
            for r in range(args.rounds):  # alternate: each round times every entry once
                for e in entries if r % 2 == 0 else entries[::-1]:
                    e.timed(args.steps)
                peak = max(peak, measure_matmul_tflops(device, dtype, peak_n, repeats=2))
            profiles = {e.kind: e.profile(args.profile) for e in entries} if args.profile else {}
        finally:
            for e in entries:
                e.close()
        median = {e.kind: statistics.median(e.times) for e in entries}
        print(peak_lines(peak, sheet, sheet_source, args.dtype))
        cfg = entry_config(args, shape, "standard")
        print(f"\nshape: {describe_shape(shape, cfg)}")
        print(f"batch {args.batch} x {cfg.max_seq_len} = {args.batch * cfg.max_seq_len} tokens/step")
        print(HEADER)
        for e in entries:
            t = median[e.kind]
            mem = "" if e.peak_mib is None else f"{e.peak_mib:.0f}"
            vs = tuple(f"{median[k] / t:.2f}x" if k in median else "" for k in ("standard", "hf_llama"))
            note = "see below" if e.kind == TRAINER else e.note
            print(table_row(e.kind, e.tokens, e.flops, t, (peak, sheet), mem, vs, note), flush=True)
        print(causal_line(args, shape, entries, median, (peak, sheet)))
        for note in dropped + [f"{e.kind}: {e.note}" for e in entries if e.kind == TRAINER]:
            print(note)
        for kind, table in profiles.items():
            print(f"\nprofile of one step: {kind}, {shape}\n{table}", flush=True)
    if args.mixit_memory:
        mixit_memory_table(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
