"""One MFU definition (model/mfu.py) for the trainer and benchmarks/bench_model.py: the peak's rule,
and the trainer's records carrying the MFU with the source of its peak."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import yaml
from conftest import REPO

import model.mfu as mfu_mod
from model import ModelConfig, preset
from model.flops import flops_per_token
from pretrain import loop
from pretrain import setup as setup_mod
from pretrain.metrics import format_line
from pretrain.train import train


def test_peak_rule_configured_then_measured_then_table(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(mfu_mod, "measure_matmul_tflops", lambda device: 7.0)
    assert mfu_mod.peak_tflops(123.0, True, cpu) == (123.0, "configured")
    assert mfu_mod.peak_tflops(None, True, cpu) == (7.0, "measured")
    assert mfu_mod.peak_tflops(None, False, cpu) == (None, "unknown")
    assert mfu_mod.table_peak_tflops("NVIDIA H100 80GB HBM3") == (989.0, "table:H100")
    assert mfu_mod.table_peak_tflops("NVIDIA GeForce RTX 4090") == (None, "unknown")
    assert mfu_mod.mfu(400.0, 800.0) == 0.5 and mfu_mod.mfu(400.0, None) is None


@pytest.mark.parametrize(
    "name, peak, source",
    [
        ("NVIDIA H100 80GB HBM3", 989.0, "table:H100"),  # the SXM part, as torch names it
        ("NVIDIA H100 PCIe", 756.0, "table:H100 PCIe"),
        ("NVIDIA H100 NVL", 835.0, "table:H100 NVL"),
        ("NVIDIA H200", 989.0, "table:H200"),
        ("NVIDIA H200 NVL", 835.0, "table:H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", 312.0, "table:A100"),
        ("NVIDIA A100 80GB PCIe", 312.0, "table:A100"),
        ("NVIDIA L40S", 362.0, "table:L40S"),
        ("NVIDIA GeForce RTX 4090", None, "unknown"),
    ],
)
def test_data_sheet_peak_by_gpu_name(name, peak, source):
    """The data-sheet dense bf16 figure for the names torch reports: a form factor's own figure before its
    family's (an H100 PCIe is not an SXM's 989)."""
    assert mfu_mod.table_peak_tflops(name) == (peak, source)


def test_measured_peak_is_a_positive_rate():
    assert 0 < mfu_mod.measure_matmul_tflops(torch.device("cpu"), n=128, repeats=2) < 1e3


def test_trainer_and_benchmark_use_the_same_definition():
    spec = importlib.util.spec_from_file_location("bench_model", REPO / "benchmarks" / "bench_model.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.mfu is mfu_mod.mfu and loop.mfu is mfu_mod.mfu
    assert bench.measure_matmul_tflops is mfu_mod.measure_matmul_tflops
    assert setup_mod.peak_tflops is mfu_mod.peak_tflops


def test_records_carry_mfu_and_its_peak_source(tmp_path, monkeypatch):
    peak = 2.5
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    over = [
        "train.max_steps=2",
        "train.eval_every_steps=0",
        "logging.tensorboard=false",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        f"logging.peak_tflops={peak}",
    ]
    train("recipes/tiny_cpu.yaml", over, run_dir=tmp_path / "run", resume="never")
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if "tflops" in r]
    assert steps
    cfg = ModelConfig.from_dict(yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"])
    full, half = (flops_per_token(cfg, 32, causal_half=c)["train"] for c in (False, True))
    for r in steps:
        assert r["mfu_peak"] == "configured"
        assert r["mfu"] == pytest.approx(r["tflops"] / peak, rel=1e-12)
        # beside it, attention's causal half only (the convention counts the whole square)
        assert r["mfu_causal"] == pytest.approx(r["mfu"] * half / full, rel=1e-12) and half < full
    assert "(causal half " in format_line(steps[-1])


def test_causal_half_counts_half_of_attention_for_causal_models_only():
    for variant in ("standard", "mixit"):
        cfg = preset("tiny", variant=variant, vocab_size=64, max_seq_len=128)
        full, half = (flops_per_token(cfg, 128, causal_half=c)["train"] for c in (False, True))
        per_layer = (12 if variant == "standard" else 4) * 128 * cfg.hidden_size  # fwd + bwd attention
        assert full - half == pytest.approx(cfg.num_layers * per_layer / 2)
        bidirectional = cfg.replace(causal=False)
        assert flops_per_token(bidirectional, 128, causal_half=True) == flops_per_token(bidirectional, 128)
