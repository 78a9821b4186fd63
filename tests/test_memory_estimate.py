"""The memory estimate (pretrain/memory.py) against what was measured: a block's activations under each
checkpointing mode against the bytes a CPU forward leaves allocated, and the totals against every peak a
GPU training run recorded in docs/data/gpu; `auto`'s choice from it."""

from __future__ import annotations

import ast
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from common.constants import REPO_ROOT
from model import preset
from model.transformer import build_model
from pretrain.config import load_recipe
from pretrain.layout import build_ds_config, plan_layout
from pretrain.memory import (
    AUTO_MEMORY_FRACTION,
    choose_checkpointing,
    estimates_by_mode,
    layer_activation_bytes,
    loss_bytes,
    resolve_checkpointing,
)
from pretrain.parallelize import apply_activation_checkpointing
from pretrain.task_model import model_config

B, T = 2, 64
# the estimate's stated error against the GPU runs' peaks
GPU_TOLERANCE = 0.10
# the 2026-11-26 runs predate the stored tiles: MixiT then took the dense matrices at T 2048
DENSE_MIXIT_BEFORE = "2026-11-28"


def forward_bytes(model, x, y) -> int:
    """Bytes a training forward leaves allocated for its backward (allocations less frees, CPU)."""
    with torch.no_grad():
        model(x, labels=y)  # the caches (MixiT's matrix, the loss's buffer) exist before the measurement
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(x, labels=y)  # held: its graph holds the saved tensors until the profile ends
    del loss
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("variant", ["standard", "mixit"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_a_blocks_activations_are_what_a_cpu_forward_keeps(variant, mode):
    """One block more adds exactly `layer_activation_bytes` per token, up to a constant per block under
    6 KiB (a checkpointed block's RNG state: 5,056 B), in fp32 and bf16; the rest (the final norm and the
    loss) within 10 % of `loss_bytes`. GQA (2 KV heads of 4); MixiT on its CPU path (dense)."""
    torch.manual_seed(0)
    x, y = torch.randint(0, 96, (B, T)), torch.randint(0, 96, (B, T))
    for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
        measured = []
        for layers in (1, 2):
            cfg = preset(
                "tiny", variant=variant, vocab_size=96, max_seq_len=T, num_layers=layers, num_kv_heads=2
            ).replace(loss_chunk_tokens=32)
            model = build_model(cfg, seed=0).to(dtype)
            apply_activation_checkpointing(model, mode)
            measured.append(forward_bytes(model, x, y))
        block = layer_activation_bytes(cfg, mode, e, "dense") * B * T
        assert 0 <= measured[1] - measured[0] - block < 6 * 1024, (dtype, measured, block)
        kept, _ = loss_bytes(cfg, B * T, e, e)
        rest = 2 * measured[0] - measured[1]  # one model less one block, the block's constant included
        assert rest == pytest.approx(kept, rel=0.1), (dtype, rest, kept)


def gpu_training_runs():
    """(run, recipe, overrides, measured peak GiB) of every training stage under docs/data/gpu: the trainer's
    command line from its log, the peak from its metrics."""
    runs = []
    for metrics in sorted((REPO_ROOT / "docs/data/gpu").glob("*/call*/train/*/uninterrupted.jsonl")):
        call, name = metrics.parents[2], metrics.parent.name
        log = next(p for p in (call / f"train_{name}.log", call / "logs" / f"train_{name}.log") if p.is_file())
        line = next(x for x in log.read_text().splitlines() if "spawned with command" in x)
        argv = ast.literal_eval(line.split("spawned with command: ", 1)[1])
        recipe = argv[argv.index("--recipe") + 1]
        overrides = [a for a in argv[argv.index("--recipe") + 2 :] if "=" in a and not a.startswith("--")]
        if "model.variant=mixit" in overrides and call.parent.name < DENSE_MIXIT_BEFORE:
            overrides.append("model.mixit_impl=dense")
        peak = max(json.loads(x)["mem_peak_gib"] for x in metrics.read_text().splitlines())
        runs.append((f"{call.parent.name}/{call.name}/{name}", recipe, overrides, peak))
    return runs


def test_the_estimate_is_within_ten_percent_of_every_measured_gpu_peak():
    """Every GPU training run on record (preset 1b, bf16, micro-batches of 8 x 2048, full checkpointing,
    ZeRO-1 and ZeRO-3, one H200): its recipe and overrides rebuilt from its log, estimated, compared with the
    peak its metrics recorded (max_memory_allocated). Their peak is the optimizer step's (the fp32 copy of
    the gradients); the activations' counts are checked on the CPU above."""
    runs = gpu_training_runs()
    assert len(runs) >= 5, runs
    h200 = 143_771_140_096  # the H200's total memory (torch's report): only `auto` would read it
    for run, recipe, overrides, peak in runs:
        cfg = load_recipe(recipe, overrides)
        layout = plan_layout(cfg, 1)
        mcfg = model_config(cfg, None)
        zero = build_ds_config(cfg, layout, on_cpu=False, hidden_size=mcfg.hidden_size)["zero_optimization"]
        est = estimates_by_mode(cfg, layout, mcfg, zero, "cuda", h200)[cfg.train.activation_checkpointing]
        assert est["total_gib"] == pytest.approx(peak, rel=GPU_TOLERANCE), (run, est["total_gib"], peak)


def test_auto_takes_the_least_recomputation_that_fits():
    totals = {"none": 40.0, "selective": 30.0, "full": 20.0}
    gib = 2**30
    assert choose_checkpointing(totals, int(48 / AUTO_MEMORY_FRACTION) * gib)[0] == "none"
    assert choose_checkpointing(totals, int(39 / AUTO_MEMORY_FRACTION) * gib)[0] == "selective"
    assert choose_checkpointing(totals, int(25 / AUTO_MEMORY_FRACTION) * gib)[0] == "full"
    mode, reason = choose_checkpointing(totals, 10 * gib)
    assert mode == "full" and "no mode fits" in reason
    # the 1b recipe at its own micro-batch on an 80 GiB and a 141 GB card, by the estimate
    cfg = load_recipe("recipes/1b_gpu_zero1.yaml", ["model.vocab_size=128256"])
    layout = plan_layout(cfg, 8)
    mcfg = model_config(cfg, None)
    zero = build_ds_config(cfg, layout, on_cpu=False, hidden_size=mcfg.hidden_size)["zero_optimization"]
    by_mode = estimates_by_mode(cfg, layout, mcfg, zero, "cuda", 80 * gib)
    totals = {m: e["total_gib"] for m, e in by_mode.items()}
    assert totals["none"] > totals["selective"] > totals["full"]
    assert choose_checkpointing(totals, 143_771_140_096)[0] == "none"


def test_resolve_keeps_a_stated_mode_and_chooses_for_auto_on_the_cpu():
    cfg = load_recipe("recipes/tiny_cpu.yaml", ["train.activation_checkpointing=selective"])
    layout = plan_layout(cfg, 1)
    mcfg = model_config(cfg, 512)
    zero = build_ds_config(cfg, layout, on_cpu=True, hidden_size=mcfg.hidden_size)["zero_optimization"]
    mode, reason, gib = resolve_checkpointing(cfg, mcfg, layout, zero, torch.device("cpu"))
    assert (mode, reason) == ("selective", "train.activation_checkpointing") and 0 < gib < 1
    cfg = load_recipe("recipes/tiny_cpu.yaml", ["train.activation_checkpointing=auto"])
    mode, reason, _ = resolve_checkpointing(cfg, mcfg, layout, zero, torch.device("cpu"))
    assert mode == "none" and reason.startswith("auto: none ")  # a tiny model fits any host
