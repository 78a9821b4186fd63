"""The chunked linear cross-entropy and compiled blocks give what the plain path gives."""

import pytest
import torch
import torch.nn.functional as F

from model import VARIANTS, preset
from model.kernels.loss import chunked_linear_cross_entropy, liger_available, linear_cross_entropy
from model.transformer import build_model

V, T = 97, 24
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def reference(h, w, y):
    return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_full_loss_and_grads(chunk):
    torch.manual_seed(0)
    h = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (50,))
    y[::5] = -100
    got = chunked_linear_cross_entropy(h, w, y, chunk)
    want = F.cross_entropy(h @ w.t(), y, ignore_index=-100)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g1 = torch.autograd.grad(got * 3.0, (h, w))
    g2 = torch.autograd.grad(want * 3.0, (h, w))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_chunked_bf16_follows_the_fp32_reference():
    """bf16 inputs: fp32 logits and softmax, bf16 matmuls for the gradients (as Liger does)."""
    torch.manual_seed(1)
    h = torch.randn(40, 32)
    w = torch.randn(V, 32) * 0.2
    y = torch.randint(0, V, (40,))
    y[::7] = -100
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    got = chunked_linear_cross_entropy(hb, wb, y, 16)
    got.backward()
    h32, w32 = hb.detach().float().requires_grad_(), wb.detach().float().requires_grad_()
    want = F.cross_entropy(h32 @ w32.t(), y, ignore_index=-100)
    want.backward()
    assert got.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(hb.grad.float(), h32.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(wb.grad.float(), w32.grad, rtol=2e-2, atol=2e-3)


def test_chunked_fp32_loss_stays_exact_where_the_target_probability_underflows():
    """Confidently wrong rows (loss of hundreds of nats, p_y below fp32's smallest normal)
    still get log_softmax's value, not a clamp; ordinary rows keep fp32 accuracy."""
    torch.manual_seed(2)
    h = torch.randn(30, 8)
    w = torch.randn(V, 8)
    h[::3] *= 40.0  # logit gaps of hundreds: p_y == 0 in fp32
    y = torch.randint(0, V, (30,))
    per_row = F.cross_entropy(h.double() @ w.double().t(), y, reduction="none")
    assert (per_row[::3] > 150).sum() >= 5 and (per_row[1::3] < 20).all()
    for chunk in (4, 64):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        got = chunked_linear_cross_entropy(hh, ww, y, chunk)
        torch.testing.assert_close(got.double(), per_row.mean(), rtol=1e-5, atol=1e-4)
        got.backward()
        h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
        F.cross_entropy(h64 @ w64.t(), y).backward()
        torch.testing.assert_close(hh.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ww.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_chunked_gradcheck_and_frozen_weight():
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1, -100, 3, 10, 0, 2])
    assert torch.autograd.gradcheck(lambda a, b: chunked_linear_cross_entropy(a, b, y, 4), (h, w))
    w.requires_grad_(False)
    (gh,) = torch.autograd.grad(chunked_linear_cross_entropy(h, w, y, 4), (h,))
    assert gh.shape == h.shape


def test_all_ignored_is_nan_like_plain_cross_entropy():
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    y = torch.full((3,), -100)
    assert torch.isnan(chunked_linear_cross_entropy(h, w, y, 2)) and torch.isnan(reference(h, w, y))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_loss_chunked_equals_full_logits(variant):
    x = torch.randint(0, V, (3, T + 1))
    labels = x[:, 1:].clone()
    labels[0, :5] = -100
    res = []
    for chunk in (0, 10):
        model = build_model(
            preset("tiny", variant=variant, vocab_size=V, max_seq_len=T, loss_chunk_tokens=chunk), seed=0
        )
        loss = model(x[:, :-1], labels=labels)
        loss.backward()
        res.append((loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-6, atol=1e-6)
    assert res[0][1].keys() == res[1][1].keys()
    for k in res[0][1]:
        torch.testing.assert_close(res[0][1][k], res[1][1][k], rtol=1e-5, atol=1e-6)


def test_tied_embeddings_gradient_is_summed():
    x = torch.randint(0, V, (2, T + 1))
    grads = []
    for chunk in (0, 16):
        model = build_model(
            preset("tiny", vocab_size=V, max_seq_len=T, tie_embeddings=True, loss_chunk_tokens=chunk), seed=0
        )
        model(x[:, :-1], labels=x[:, 1:]).backward()
        grads.append(model.embed_tokens.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_no_grad_loss_does_no_backward_work():
    from torch.utils.flop_counter import FlopCounterMode

    h, w, y = torch.randn(8, 16), torch.randn(V, 16), torch.randint(0, V, (8,))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        chunked_linear_cross_entropy(h, w, y, 3)
    assert counter.get_total_flops() == 2 * 8 * 16 * V


def _compiled_vs_eager(variant):
    x = torch.randint(0, V, (2, T + 1))
    res = []
    for compile_blocks in (False, True):
        model = build_model(
            preset("tiny", variant=variant, vocab_size=V, max_seq_len=T, num_layers=1, compile_blocks=compile_blocks),
            seed=0,
        )
        loss = model(x[:, :-1], labels=x[:, 1:])
        loss.backward()
        res.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}, list(model.state_dict())))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-5, atol=1e-5)
    assert res[0][2] == res[1][2]  # in-place compile: no _orig_mod in the names
    for k, g in res[0][1].items():
        if g is not None:
            torch.testing.assert_close(g, res[1][1][k], rtol=1e-4, atol=1e-5)


def test_compiled_blocks_equal_eager_inductor():
    """compile_blocks with the default backend (inductor; on CPU it generates C++): same loss and grads."""
    _compiled_vs_eager("standard")


def test_compiled_mixit_blocks_equal_eager():
    """MixiT's blocks compile with inductor too: the mixing matrix is built outside the compiled graph
    (once, then cached); traced into it, a width-8 model's first step did not finish in 5 minutes."""
    _compiled_vs_eager("mixit")


@pytest.mark.gpu
@gpu
def test_liger_equals_chunked_on_gpu():
    if not liger_available():
        pytest.skip("liger-kernel not installed")
    h = torch.randn(300, 64, device="cuda", requires_grad=True)
    w = torch.randn(1000, 64, device="cuda", requires_grad=True)
    y = torch.randint(0, 1000, (300,), device="cuda")
    got = linear_cross_entropy(h, w, y, 128)
    want = chunked_linear_cross_entropy(h, w, y, 128)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    g1, g2 = torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_chunked_loss_never_waits_for_the_device():
    """No data-dependent branch (the underflow rows included): forward and backward never read
    a value back to the host, so on a GPU the chunks queue without a sync."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (
                torch.ops.aten._local_scalar_dense.default,
                torch.ops.aten.is_nonzero.default,
                torch.ops.aten.item.default,
            ):
                reads.append(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(3)
    h, w = torch.randn(30, 8), torch.randn(V, 8)
    h[::3] *= 40.0  # rows whose p_y underflows take the same path
    y = torch.randint(0, V, (30,))
    y[1] = -100
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with HostReads():
        loss = chunked_linear_cross_entropy(hh, ww, y, 4)
        loss.backward()
    assert reads == []
    torch.testing.assert_close(
        loss.double(), F.cross_entropy(h.double() @ w.double().t(), y, ignore_index=-100), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("chunk", [0, 7])
def test_sum_reduction_equals_the_summed_full_loss(chunk):
    torch.manual_seed(4)
    h = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (20,))
    y[::4] = -100
    got = linear_cross_entropy(h, w, y, chunk, reduction="sum")
    want = F.cross_entropy(h @ w.t(), y, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    none = torch.full((20,), -100)
    assert linear_cross_entropy(h, w, none, chunk, reduction="sum").item() == 0.0  # no token: 0, not nan
