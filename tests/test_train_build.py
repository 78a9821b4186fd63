"""Each rank builds only what it owns (pretrain/parallelize.py), with the weights of one process;
activation checkpointing applied from outside recomputes every block, masks or not; the pipeline's
last stage and ZeRO-3 take the chunked loss, equal to the full-logits one."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import read_losses, run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from checkpoint import load_for_eval
from model import VARIANTS, preset
from model.classifier import build_classifier
from model.transformer import Transformer, build_model
from pretrain.parallelize import apply_activation_checkpointing, materialise, resident_parameter_bytes
from pretrain.pipeline import pipe_loss
from pretrain.train import train

V, T = 97, 24


# ---- initial values by name ---------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_meta_build_materialises_the_single_process_weights_tensor_by_tensor(variant):
    """Any subset of tensors, materialised from the meta device, equals the full build bit for bit
    (frozen Q/K included); a tensor's value does not depend on the others (more layers, same layer 0)."""
    cfg = preset("tiny", variant=variant, vocab_size=V, max_seq_len=T, tie_embeddings=True)
    full = dict(build_model(cfg, seed=7).named_parameters())
    with torch.device("meta"):
        meta = Transformer(cfg, init_seed=7)
    names = {id(p): n for n, p in meta.named_parameters()}
    owned = meta.layers[1]  # e.g. one pipeline stage's block
    materialise(owned, names, meta.initial_value, torch.device("cpu"))
    for n, p in meta.named_parameters():
        if n.startswith("layers.1."):
            assert torch.equal(p, full[n]) and p.requires_grad == full[n].requires_grad, n
        else:
            assert p.is_meta, n
    assert resident_parameter_bytes(meta) == sum(p.numel() * 4 for p in owned.parameters())
    materialise(meta, names, meta.initial_value, torch.device("cpu"))
    assert meta.lm_head.weight is meta.embed_tokens.weight  # ties survive materialisation
    for n, p in meta.named_parameters():
        assert torch.equal(p, full[n]), n
    deeper = dict(
        build_model(
            preset("tiny", variant=variant, vocab_size=V, max_seq_len=T, tie_embeddings=True, num_layers=3), seed=7
        ).named_parameters()
    )
    assert all(torch.equal(deeper[n], p) for n, p in full.items())
    other = dict(build_model(cfg, seed=8).named_parameters())
    assert not torch.equal(other["layers.0.mlp.up_proj.weight"], full["layers.0.mlp.up_proj.weight"])


def test_frozen_qk_keeps_the_qk_init_scale():
    cfg = preset("tiny", variant="frozen_qk", vocab_size=V, max_seq_len=T)
    m = build_model(cfg, seed=0)
    q, up = m.layers[0].self_attn.q_proj.weight, m.layers[0].mlp.up_proj.weight
    assert not q.requires_grad
    assert abs(float(q.detach().std()) - cfg.qk_init_std) < 0.2 * cfg.qk_init_std
    assert abs(float(up.detach().std()) - cfg.init_std) < 0.2 * cfg.init_std


# ---- activation checkpointing from outside -----------------------------------------------------


def _mlp_calls(model) -> list[int]:
    """A counter of MLP forwards begun (a recomputation may stop early, before one returns)."""
    calls = [0]
    for m in model.modules():
        if type(m).__name__ == "MLP":
            m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("masked", [False, True])
def test_activation_checkpointing_recomputes_every_block_with_and_without_masks(masked, mode):
    """Against the plain model (mode none): the same loss and gradients, bit for bit; `selective` runs each
    block's forward again too (its matrix products and attention are replayed from what it kept)."""
    cfg = preset("tiny", vocab_size=V, max_seq_len=T, causal=True, num_kv_heads=2)
    x = torch.randint(0, V, (2, T + 1))
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24]) if masked else None
    results = []
    for ac in (False, True):
        model = build_model(cfg, seed=0)
        keys = list(model.state_dict())
        assert apply_activation_checkpointing(model, mode if ac else "none") == (cfg.num_layers if ac else 0)
        calls = _mlp_calls(model)
        loss = model(x[:, :-1], labels=x[:, 1:], doc_ids=doc_ids)
        loss.backward()
        assert calls[0] == cfg.num_layers * (2 if ac else 1)  # recomputed in backward
        assert list(model.state_dict()) == keys  # names and state dict unchanged
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        with torch.no_grad():
            calls[0] = 0
            model(x[:, :-1], doc_ids=doc_ids)
            assert calls[0] == cfg.num_layers  # no gradient: nothing to recompute
    assert torch.equal(results[0][0], results[1][0])
    for n, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][n], g, rtol=0, atol=0)


def test_activation_checkpointing_reaches_a_classifiers_masked_backbone():
    """A bidirectional classifier masks its pads: the blocks are still recomputed."""
    cfg = preset("tiny", vocab_size=32, max_seq_len=16, causal=False)
    x = torch.randint(1, 32, (3, 12))
    x[0, 8:] = 0  # padding: a document mask
    labels = torch.tensor([0, 2, 1])
    grads = []
    for ac in (False, True):
        clf = build_classifier(cfg, num_labels=3, pad_id=0, seed=0)
        if ac:
            apply_activation_checkpointing(clf)
        calls = _mlp_calls(clf)
        clf(x, labels).backward()
        assert calls[0] == cfg.num_layers * (2 if ac else 1)
        grads.append({n: p.grad for n, p in clf.named_parameters() if p.grad is not None})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=0, atol=0)


# ---- no full logits ------------------------------------------------------------------------


class LogitRows(TorchDispatchMode):
    """The most rows of vocab-wide logits any op wrote (views, e.g. of the head matrix, aside)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [0, 8])
def test_model_loss_holds_at_most_one_chunk_of_logits(chunk):
    cfg = preset("tiny", vocab_size=V, max_seq_len=T, loss_chunk_tokens=chunk)
    model = build_model(cfg, seed=0)
    x = torch.randint(0, V, (3, T + 1))
    with LogitRows(V) as seen:
        model(x[:, :-1], labels=x[:, 1:], reduction="sum").backward()
    assert seen.rows == (3 * T if chunk == 0 else chunk)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_last_stage_loss_is_chunked_and_equals_the_full_logits_loss(tied):
    """The head layer hands (hidden states, head matrix) to pipe_loss: same loss and gradients
    as cross-entropy over the full fp32 logits, without them."""
    torch.manual_seed(0)
    h = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (2, 12))
    y[0, :3] = -100
    scale = torch.tensor([0.25], dtype=torch.float64)
    with LogitRows(V) as seen:
        got = pipe_loss((h, w), (y, scale), chunk=5)
        g_got = torch.autograd.grad(got, (h, w))
    assert seen.rows == 5
    want = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum") * 0.25
    g_want = torch.autograd.grad(want, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---- two real ranks ------------------------------------------------------------------------

RECIPE = "recipes/tiny_cpu.yaml"
COMMON = [
    "model.variant=frozen_qk",
    "model.tie_embeddings=true",
    "train.max_steps=6",
    "train.eval_every_steps=0",
    "logging.tensorboard=false",
    "checkpoint.every_steps=0",
    "checkpoint.keep_last=0",
]
TOL = dict(rel=1e-5, abs=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, ZeRO-1, the same recipe: its losses and its model's tensors."""
    res = train(RECIPE, COMMON, run_dir=tmp_path_factory.mktemp("ref"), resume="never")
    model, _ = load_for_eval(res.run_dir)
    return res.losses, model


def _resident(out: str) -> tuple[list[int], int]:
    m = re.search(r"parameter bytes resident per rank: ([\d, ]+) \(the whole model: ([\d,]+)\)", out)
    assert m, out[-3000:]
    return [int(b.replace(",", "")) for b in m.group(1).split(", ")], int(m.group(2).replace(",", ""))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3", "pipeline"])
def test_two_ranks_hold_only_their_share_and_train_like_one_process(layout, reference, tmp_path):
    ref_losses, ref_model = reference
    ref_params = list(ref_model.parameters())  # the tied matrix once
    pick = (
        ["parallel.ds_config=zero3"]
        if layout == "zero3"
        else ["parallel.ds_config=pipeline", "parallel.pipeline_stages=2"]
    )
    base = ["--recipe", RECIPE, *pick, *COMMON]
    out = run_ranks([*base, "--run-dir", str(tmp_path / "ac"), "train.activation_checkpointing=true"])
    per_rank, whole = _resident(out)
    assert whole == sum(p.numel() * 4 for p in ref_params)
    if layout == "zero3":  # each rank: its half of every tensor (padded to an even count)
        assert per_rank == [sum((p.numel() + 1) // 2 * 4 for p in ref_params)] * 2
    else:  # each rank: its stage's layers; the tied embedding lives on both ends
        assert sum(per_rank) == whole + ref_model.embed_tokens.weight.numel() * 4 and max(per_rank) < whole
    got = read_losses(tmp_path / "ac")
    for s in range(1, 7):
        assert got[s] == pytest.approx(ref_losses[s], **TOL), f"step {s}: {got[s]} vs {ref_losses[s]}"
    # the same layout with the full-logits loss: the chunked loss there equals it
    run_ranks([*base, "--run-dir", str(tmp_path / "full"), "model.loss_chunk_tokens=0"])
    full = read_losses(tmp_path / "full")
    for s in range(1, 7):
        assert got[s] == pytest.approx(full[s], **TOL), f"step {s}: chunked {got[s]} vs full logits {full[s]}"
