"""Training-step throughput of every variant, side by side with HuggingFace Llama at the identical
config: tokens/s, TFLOP/s, MFU and peak memory (the method: docs/PERFORMANCE.md, Benchmark).

Each entry lives in its own worker process, so no entry pays for another's memory (on CPU, large
allocations cost page faults that depend on what else the process holds); timed rounds alternate
between the workers, one active at a time, so that drift in machine speed hits each alike.

    python benchmarks/bench_model.py                          # the CPU table of docs/PERFORMANCE.md
    python benchmarks/bench_model.py --mixit-memory 1024 2048 4096
    python benchmarks/bench_model.py --device cuda --dtype bf16 --compile --sizes 12x768x1024
    python benchmarks/bench_model.py --variants standard mixit --no-hf --profile 15   # where a step's time goes
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from model import build_model, preset  # noqa: E402
from model.flops import flops_per_token  # noqa: E402
from model.hf import llama_config  # noqa: E402
from model.mfu import measure_matmul_tflops, mfu  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANT_NAMES = ["standard", "frozen_qk", "frozen_mlp", "mixit", "random_transformer"]
# more entries by name: MixiT on one path whatever the memory rule of model/kernels/select.py picks
# (mixit_dense: the cached matrix; mixit_triton: the kernel), and the kernel drawing M four entries per
# Philox call (mixit_philox4x)
NAMED_KINDS = {
    "mixit_dense": ("mixit", {"mixit_impl": "dense"}),
    "mixit_triton": ("mixit", {"mixit_impl": "triton"}),
    "mixit_philox4x": ("mixit", {"mixit_impl": "triton", "mixit_rng": "philox4x"}),
}


def parse_size(s: str) -> tuple[int, int, int]:
    layers, width, seq = (int(x) for x in s.split("x"))
    return layers, width, seq


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Entry:
    """One thing to time: our model in a variant, or the HF reference."""

    def __init__(self, args, size: str, kind: str, **over):
        self.kind = kind
        self.device, self.dtype = torch.device(args.device), DTYPES[args.dtype]
        variant, named = NAMED_KINDS.get(kind, ("standard" if kind == "hf_llama" else kind, {}))
        layers, width, seq = parse_size(size)
        heads = max(1, width // 64)
        self.cfg = preset(
            "s",
            hidden_size=width,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads,
            intermediate_size=None,
            vocab_size=args.vocab,
            max_seq_len=seq,
            variant=variant,
            compile_blocks=args.compile,
            **named,
            **over,
        )
        torch.manual_seed(0)
        if kind == "hf_llama":
            hf_cfg = llama_config(self.cfg.replace(compile_blocks=False))
            hf_cfg._attn_implementation = "sdpa"
            self.model = LlamaForCausalLM(hf_cfg).to(self.device, self.dtype).train()
            if args.compile:
                for layer in self.model.model.layers:
                    layer.compile()
        else:
            self.model = build_model(self.cfg, seed=0, device=self.device).to(self.dtype).train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        # ours: the trainer's optimizer (torch AdamW, fused kernel: pretrain/layout.py), unless
        # --plain-adamw; the HF reference: a plain AdamW loop, as a HF user would write it
        self.opt = torch.optim.AdamW(params, lr=1e-4, fused=kind != "hf_llama" and not args.plain_adamw)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, args.vocab, (args.batch, seq + 1), generator=g).to(self.device)
        self.tokens = args.batch * seq
        self.flops = flops_per_token(self.cfg, seq)["train"] * self.tokens

    def step(self):
        inp, lab = self.x[:, :-1], self.x[:, 1:]
        if self.kind == "hf_llama":
            # HF shifts labels itself: give it the same t tokens and t scored targets
            logits = self.model(input_ids=inp).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), lab.flatten())
        else:
            loss = self.model(inp, labels=lab)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

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
        from torch.profiler import ProfilerActivity, profile  # deferred: only with --profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            self.step()
            sync(self.device)
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        return prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60)


def _worker_main(conn, args, size: str, kind: str):
    """Build one entry, warm it up, then time `steps` steps (or profile one) whenever asked. Every
    entry stays resident but only one runs at a time, so each hands its cached device memory back
    before it replies: the entries' activations need not fit side by side."""
    e = Entry(args, size, kind)
    e.step()  # warm-up (and compilation)
    e.step()
    release = torch.cuda.empty_cache if e.device.type == "cuda" else (lambda: None)
    release()
    conn.send((e.tokens, e.flops))
    while (msg := conn.recv()) is not None:
        reply = e.profile(msg[1]) if isinstance(msg, tuple) else e.timed(msg)  # ("profile", top) or steps
        release()
        conn.send(reply)


class Worker:
    """An Entry in its own process; the parent only asks it to run timed rounds."""

    def __init__(self, args, size: str, kind: str):
        self.kind = kind
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, args, size, kind), daemon=True)
        self.proc.start()
        self.tokens, self.flops = self._recv()
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
    cmd += ["--vocab", str(args.vocab), "--batch", str(args.batch), "--device", args.device]
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
    kind = args._memory_child
    over = {"mixit_impl": args.mixit_impl} if args.mixit_impl else {}
    e = Entry(args, args.sizes[0], kind, **over)
    try:  # reset the peak RSS (a forked child inherits its parent's)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    if e.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        e.step()
    sync(e.device)
    peak = torch.cuda.max_memory_allocated() / 2**20 if e.device.type == "cuda" else _vm_hwm_mib()
    print(json.dumps({"peak_mib": peak}))


def mixit_memory_table(args):
    print(
        f"\nMixiT memory vs T (1 layer of width {args.mixit_width}, batch 1, {args.dtype}, one fwd+bwd step; "
        f"peak {'CUDA allocated' if args.device == 'cuda' else 'process RSS'} in MiB)"
    )
    print(f"{'T':>6} {'impl':>8} {'peak MiB':>10} {'H*T^2*4B per layer (MiB)':>26}")
    for T in args.mixit_memory:
        heads = max(1, args.mixit_width // 64)
        for impl in args.mixit_impls:
            a = argparse.Namespace(**{**vars(args), "batch": 1})
            mib = memory_of(a, f"1x{args.mixit_width}x{T}", "mixit", ["--mixit-impl", impl])
            print(f"{T:>6} {impl:>8} {mib:>10.0f} {heads * T * T * 4 / 2**20:>26.0f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["4x256x256"], help="LAYERSxWIDTHxSEQ (heads = width/64)")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=VARIANT_NAMES,
        help=f"none: only the MixiT memory table; also {list(NAMED_KINDS)}",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the HuggingFace reference")
    ap.add_argument("--vocab", type=int, default=32000)
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
    ap.add_argument("--no-memory", action="store_true")
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
    ap.add_argument("--mixit-impl", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory_child:
        return memory_child(args)

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    print(
        f"device={device} ({torch.get_num_threads()} threads) dtype={args.dtype} compile={args.compile} "
        f"vocab={args.vocab} batch={args.batch} torch={torch.__version__}"
    )
    peak_n = args.peak_n or (8192 if device.type == "cuda" else 2048)
    peak = measure_matmul_tflops(device, dtype, peak_n) if args.variants else 0.0
    for size in args.sizes if args.variants else []:
        kinds = list(args.variants) + ([] if args.no_hf else ["hf_llama"])
        entries = [Worker(args, size, k) for k in kinds]  # built and warmed up (compiled) one by one
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
        print(f"MFU peak: {peak:.3f} TFLOP/s (measured: square matmul, best over rounds; model/mfu.py)")
        print(f"\nsize {size} (layers x width x seq), {args.batch * parse_size(size)[2]} tokens/step")
        print(
            f"{'model':<20} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'GFLOP/tok':>9} {'peak MiB':>9} "
            f"{'vs std':>7} {'vs HF':>7}"
        )
        for e in entries:
            t = median[e.kind]
            tps = e.tokens / t
            tf = e.flops / t / 1e12
            mem = "" if args.no_memory else f"{memory_of(args, size, e.kind, []):.0f}"
            vs_std, vs_hf = (f"{median[k] / t:.2f}x" if k in median else "" for k in ("standard", "hf_llama"))
            print(
                f"{e.kind:<20} {tps:>9.0f} {tf:>8.4f} {mfu(tf, peak):>6.1%} {e.flops / e.tokens / 1e9:>9.4f} "
                f"{mem:>9} {vs_std:>7} {vs_hf:>7}",
                flush=True,
            )
        for kind, table in profiles.items():
            print(f"\nprofile of one step: {kind}, size {size}\n{table}", flush=True)
    if args.mixit_memory:
        mixit_memory_table(args)


if __name__ == "__main__":
    main()
