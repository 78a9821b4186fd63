"""benchmarks/bench_model.py on the CPU, without timing anything: `--preset NAME` builds exactly
model.preset(NAME) (the model the trainer trains), a custom shape says it is one, the trainer's entry
is the 1b recipe's engine on that same model, and every MFU is stated against both the measured matmul
peak and the data sheet's dense bf16 peak (checked on the numbers of docs/data/gpu)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from model import param_count, preset
from model.transformer import build_model
from pretrain.layout import plan_layout

spec = importlib.util.spec_from_file_location("bench_model", REPO / "benchmarks" / "bench_model.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

BENCH = [sys.executable, str(REPO / "benchmarks" / "bench_model.py")]


def parsed(*argv: str):
    """bench_model's arguments as main() leaves them after its checks."""
    args = bench.build_parser().parse_args(["--device", "cpu", *argv])
    bench.check_args(args)
    return args


def test_preset_1b_builds_exactly_the_preset():
    args = parsed("--preset", "1b", "--variants", "standard", "mixit_triton")
    assert bench.shapes_of(args) == ["1b@2048"]  # the preset's own length by default
    cfg = bench.entry_config(args, "1b@2048", "standard")
    assert cfg == preset("1b")
    assert (cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size, cfg.tie_embeddings) == (8, 8192, 128256, True)
    with torch.device("meta"):  # the model itself, without allocating its 1.2 B parameters
        model = build_model(cfg)
    assert model.cfg == preset("1b")
    assert sum(p.numel() for p in model.parameters()) == param_count(preset("1b"))["total"]
    assert bench.entry_config(args, "1b@2048", "mixit_triton") == preset("1b", variant="mixit", mixit_impl="triton")

    args = parsed("--preset", "1b", "--seq", "2048", "8192")
    assert bench.shapes_of(args) == ["1b@2048", "1b@8192"]
    assert bench.entry_config(args, "1b@8192", "frozen_qk") == preset("1b", variant="frozen_qk", max_seq_len=8192)


def test_custom_shape_is_labelled_custom_and_is_not_the_1b_preset():
    """The earlier GPU runs' "1b shape" (16x2048, preset s's settings) is another model than preset 1b."""
    args = parsed("--sizes", "16x2048x2048", "--vocab", "128256")
    custom = bench.entry_config(args, "16x2048x2048", "standard")
    assert custom != preset("1b")
    label = bench.describe_shape("16x2048x2048", custom)
    assert label.startswith("custom 16x2048x2048") and "not a preset" in label
    assert "32 KV heads, MLP 5504" in label and "untied" in label
    label = bench.describe_shape("1b@8192", preset("1b", max_seq_len=8192))
    assert label.startswith("preset 1b, T 8192: model.preset('1b', max_seq_len=8192)")
    assert "8 KV heads, MLP 8192, vocab 128256, tied" in label


def test_trainer_entry_is_the_1b_recipe_on_the_same_model():
    """ZeRO-1 and activation checkpointing `auto`, as recipes/1b_gpu_zero1.yaml trains, on the benchmark's batch."""
    args = parsed("--preset", "1b", "--variants", "trainer", "--batch", "4", "--dtype", "bf16")
    cfg, mcfg = bench.trainer_config(args, "1b@2048")
    assert mcfg == preset("1b")
    assert cfg.train.activation_checkpointing == "auto" and cfg.train.precision == "bf16"
    layout = plan_layout(cfg, 1)
    assert (layout.zero_stage, layout.micro_batch, layout.grad_accum) == (1, 4, 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "1b", "--sizes", "4x64x64"], "--preset and --sizes"),
        (["--preset", "1b", "--vocab", "512"], "--vocab would change preset 1b"),
        (["--seq", "2048"], "--seq sets a preset's length"),
        (["--preset", "2b"], "unknown preset '2b'"),
        (["--variants", "mixit_fast"], "unknown entry 'mixit_fast'"),
        (["--sizes", "4x64x64", "--variants", "trainer"], "trains a preset"),
    ],
)
def test_bad_arguments_are_one_error_line(argv, message, capsys):
    code = bench.run_cli(lambda: parsed(*argv))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "Fix: " in lines[0] and message in lines[0], lines


def test_the_command_line_refuses_with_one_line_and_no_traceback():
    out = subprocess.run([*BENCH, "--preset", "1b", "--sizes", "4x64x64"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: --preset and --sizes") and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_dry_run_labels_the_shapes_of_the_gpu_commands():
    out = subprocess.run(
        [*BENCH, "--device", "cuda", "--dtype", "bf16", "--preset", "1b", "--seq", "2048", "8192", "--batch", "1"]
        + ["--variants", "standard", "mixit", "mixit_triton", "trainer", "--no-hf", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "shape: preset 1b, T 2048: model.preset('1b', max_seq_len=2048)" in out.stdout
    assert "shape: preset 1b, T 8192" in out.stdout
    assert "standard: 8.2198 GFLOP/token" in out.stdout and "trainer: 8.2198 GFLOP/token" in out.stdout
    assert "MixiT path: the device decides" in out.stdout  # no GPU here to apply the memory rule
    assert out.stdout.rstrip().endswith("dry run: nothing built or timed")


def test_an_entry_on_the_same_path_as_another_is_not_timed_twice():
    args = parsed("--preset", "tiny", "--seq", "64", "--variants", "mixit", "mixit_dense", "mixit_triton")
    kinds, notes = bench.distinct_kinds(args, "tiny@64", args.variants)
    assert kinds == ["mixit", "mixit_triton"]  # on a CPU the rule puts T 64 on the dense path
    assert notes == ["mixit_dense: not timed, the same model on the same path (dense) as mixit here"]


def test_mfu_against_the_measured_and_the_data_sheet_peak():
    """Run 2's compiled standard entry (docs/data/gpu/2026-11-26_h200_run2/call1/logs/bench_compiled_T2048.log):
    59,913 tok/s at 7.2383 GFLOP/token over the measured 784.596 TFLOP/s is 55.3 %, over the H200's
    data-sheet 989 TFLOP/s 43.8 %."""
    tokens = 8192
    seconds = tokens / 59913
    row = bench.table_row("standard", tokens, 7.2383e9 * tokens, seconds, (784.596, 989.0), "", ("1.00x", ""), "")
    assert row.split()[:6] == ["standard", "59913", "433.6683", "55.3%", "43.8%", "7.2383"]
    lines = bench.peak_lines(784.596, 989.0, "table:H200", "bf16").splitlines()
    assert lines[0].startswith("MFU peak, measured: 784.596 TFLOP/s (bf16 square matmul")
    assert lines[1].startswith("MFU peak, data sheet: 989.0 TFLOP/s (table:H200")
    # no data-sheet figure: a CPU, or an fp32 run (the table holds bf16 figures)
    assert bench.sheet_peak(torch.device("cpu"), torch.float32)[0] is None
    assert bench.sheet_peak(torch.device("cuda"), torch.float32)[0] is None
    row = bench.table_row("standard", tokens, 7.2383e9 * tokens, seconds, (784.596, None), "", ("", ""), "")
    assert row.split()[3:5] == ["55.3%", "-"]
    assert "unknown" in bench.peak_lines(0.2, None, "none", "fp32").splitlines()[1]


def test_causal_half_mfu_beside_the_tables():
    """Beside the table's MFU (the whole T x T square), each entry's with attention's causal half only."""

    class Done:  # a timed entry, as the parent holds it
        def __init__(self, kind, flops):
            self.kind, self.flops = kind, flops

    args = parsed("--preset", "tiny", "--seq", "64", "--variants", "standard", "mixit")
    cfgs = {k: bench.entry_config(args, "tiny@64", k) for k in ("standard", "mixit")}
    entries = [Done(k, bench.flops_per_token(c, 64)["train"] * 64) for k, c in cfgs.items()]
    line = bench.causal_line(args, "tiny@64", entries, {"standard": 1e-6, "mixit": 1e-6}, (1.0, 2.0))
    for kind, cfg in cfgs.items():
        half = bench.flops_per_token(cfg, 64, causal_half=True)["train"] * 64 / 1e-6 / 1e12
        assert f"{kind} {half:.1%} (sheet {half / 2:.1%})" in line, line
    assert line.startswith("MFU of attention's causal half (the table counts the whole square): standard ")


def test_a_path_per_layer_is_named_with_its_layers():
    """The tiles chunked by layer (model/kernels/select.py): the entry's path names each path's layers."""
    assert bench.layer_ranges(["streamed"] * 8 + ["triton"] * 8) == "streamed (layers 0-7), triton (layers 8-15)"
    assert bench.layer_ranges(["streamed", "triton"]) == "streamed (layer 0), triton (layer 1)"
    assert bench.layer_ranges(["dense"] * 3) == "dense"
