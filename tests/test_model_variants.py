"""Every variant: causality, freezing semantics, the freeze schedule, masking, caching."""

import pytest
import torch
from fixtures import OpDtypes

from model import VARIANTS, preset
from model.freezing import groups_of
from model.transformer import build_model

V, T = 97, 24


def tiny(variant, **kw):
    return preset("tiny", variant=variant, vocab_size=V, max_seq_len=T, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causality(variant):
    model = build_model(tiny(variant), seed=0).eval()
    x = torch.randint(0, V, (2, T))
    for i in (0, 7, T - 2):
        y = x.clone()
        y[:, i + 1 :] = torch.randint(0, V, (2, T - i - 1))
        with torch.no_grad():
            a, b = model(x), model(y)
        assert torch.equal(a[:, : i + 1], b[:, : i + 1])
        assert not torch.allclose(a[:, i + 1 :], b[:, i + 1 :])


EXPECTED_FROZEN = {
    "standard": set(),
    "frozen_qk": {"q_proj", "k_proj"},
    "frozen_mlp": {"gate_proj", "up_proj", "down_proj"},
    "mixit": set(),
    "shaped": set(),
    "random_transformer": {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "input_layernorm",
        "post_attention_layernorm",
        "norm",
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_frozen_tensors_unchanged_and_stateless(variant):
    torch.manual_seed(0)
    model = build_model(tiny(variant), seed=0)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    kinds = {n.split(".")[-2] for n in frozen}
    assert kinds == EXPECTED_FROZEN[variant]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(20):
        x = torch.randint(0, V, (4, T))
        loss = model(x[:, :-1], labels=x[:, 1:])
        opt.zero_grad()
        loss.backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and p.grad.abs().sum() > 0, f"{n} got no gradient"
            else:
                assert p.grad is None, f"frozen {n} got a gradient"
        opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen {n} changed"
        else:
            assert not torch.equal(p, before[n]), f"trainable {n} did not change"
    state_ids = {id(p) for p in opt.state}
    assert all(id(p) not in state_ids for n, p in model.named_parameters() if n in frozen)


def test_qk_init_std_is_one_key_for_trained_and_frozen_qk():
    d = 256
    for variant in ("frozen_qk", "standard"):  # the same initial Q/K: freezing is the only difference
        cfg = preset("s", variant=variant, vocab_size=V, max_seq_len=T)
        q = build_model(cfg, seed=0).layers[0].self_attn.q_proj.weight
        assert abs(q.std().item() - d**-0.5) < 0.05 * d**-0.5, variant  # paper: N(0, 1/d)
        model = build_model(cfg.replace(qk_init_std=0.02), seed=0)  # reference code: 0.02
        assert abs(model.layers[0].self_attn.q_proj.weight.std().item() - 0.02) < 0.002, variant
        assert abs(model.layers[0].self_attn.v_proj.weight.std().item() - 0.02) < 0.002, variant
    a = build_model(preset("s", variant="standard", vocab_size=V, max_seq_len=T), seed=0)
    b = build_model(preset("s", variant="frozen_qk", vocab_size=V, max_seq_len=T), seed=0)
    assert all(torch.equal(p, dict(b.named_parameters())[n]) for n, p in a.named_parameters())


def test_mixit_width_factors_of_the_reference():
    """The reference's MixiT at width 64: every projection and the LM head times sqrt(512/64), down_proj
    times sqrt(1/256); the logits are the head's plain product with that factor."""
    cfg = tiny("mixit", hidden_size=64, intermediate_size=256, mixit_width_base=512)
    ref = cfg.replace(mixit_down_width_base=1, mixit_head_width_base=512)
    plain, scaled = build_model(cfg, seed=0), build_model(ref, seed=0)
    assert plain.layers[0].mlp.down_proj.out_scale == pytest.approx((512 / 256) ** 0.5)
    assert scaled.layers[0].mlp.down_proj.out_scale == pytest.approx(1 / 16)
    assert scaled.layers[0].mlp.up_proj.out_scale == pytest.approx(8**0.5)
    x = torch.randint(0, V, (2, 8))
    h = scaled(x, return_hidden=True)
    want = (
        torch.nn.functional.rms_norm(h, (64,), scaled.norm.weight, cfg.rms_norm_eps) * 8**0.5 @ scaled.lm_head.weight.T
    )
    torch.testing.assert_close(scaled(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mixit_head_width_base"):
        cfg.replace(mixit_head_width_base=0)


def test_freeze_schedule_unfreezes():
    model = build_model(tiny("frozen_qk", freeze_schedule=[[5, []]]), seed=0)
    q = model.layers[0].self_attn.q_proj.weight
    assert not q.requires_grad
    model.set_step(4)
    assert not q.requires_grad
    model.set_step(5)
    assert q.requires_grad and all(p.requires_grad for p in model.parameters())


def test_groups_of_names():
    assert groups_of("layers.3.self_attn.q_proj.weight") == {"qk", "blocks"}
    assert groups_of("layers.0.mlp.down_proj.bias") == {"mlp", "blocks"}
    assert groups_of("embed_positions.weight") == {"embeddings"}
    assert groups_of("lm_head.weight") == {"head"}
    assert groups_of("embed_tokens.weight", tied=True) == {"embeddings", "head"}
    assert groups_of("norm.weight") == {"norms"}


def test_tied_embeddings_share_storage():
    model = build_model(tiny("standard", tie_embeddings=True), seed=0)
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("variant", ["standard", "mixit"])
def test_shorter_sequences_are_prefixes(variant):
    model = build_model(tiny(variant), seed=0).eval()
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        full, short = model(x), model(x[:, :10])
    torch.testing.assert_close(short, full[:, :10], rtol=1e-5, atol=1e-5)


def test_too_long_sequence_is_a_clear_error():
    model = build_model(tiny("standard"), seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, T + 1, dtype=torch.long))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_equals_full_forward(variant):
    model = build_model(tiny(variant), seed=0).eval()
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        parts = [model(x[:, :9], cache=cache)] + [model(x[:, i : i + 1], cache=cache) for i in range(9, T)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant, kv", [("standard", None), ("frozen_qk", None), ("mixit", None), ("mixit", 2)])
def test_document_mask_isolates_documents(variant, kv):
    """A packed row with doc_ids gives every document the logits it has alone: masking, and for
    MixiT (mixing indexed by absolute position) the position reset too, also with GQA (kv: V's heads)."""
    model = build_model(tiny(variant, num_kv_heads=kv), seed=0).eval()
    docs = [torch.randint(0, V, (1, n)) for n in (10, 3, 11)]
    other = [torch.randint(0, V, (1, n)) for n in (24,)]
    packed = torch.cat([torch.cat(docs, dim=1), torch.cat(other, dim=1)])
    doc_ids = torch.tensor([[0] * 10 + [1] * 3 + [2] * 11, [0] * 24])
    with torch.no_grad(), OpDtypes() as ops:
        out = model(packed, doc_ids=doc_ids)
    if kv:  # V at every head (with one V head per head that is V's own size, which matmul's views take)
        repeated = 2 * model.cfg.num_heads * 24 * model.cfg.head_dim
        assert not [op for op, _, n in ops.seen if ("expand" in op or "repeat" in op) and n == repeated], ops.seen
    with torch.no_grad():
        alone = torch.cat([model(d) for d in docs], dim=1)
        torch.testing.assert_close(out[:1], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1:], model(other[0]), rtol=1e-5, atol=1e-5)
        if variant == "mixit":  # without the reset the later documents would see other positions' weights
            assert (out[:1, 10:] - model(packed[:1])[:, 10:]).abs().max() > 1e-3


def test_mixit_document_reset_refuses_a_kv_cache():
    model = build_model(tiny("mixit"), seed=0).eval()
    with pytest.raises(NotImplementedError, match="doc_ids"):
        model(torch.zeros(1, 4, dtype=torch.long), doc_ids=torch.tensor([[0, 0, 1, 1]]), cache=model.new_cache())


@pytest.mark.parametrize("variant", ["standard", "mixit"])
def test_bf16_forward_close_to_fp32(variant):
    model = build_model(tiny(variant), seed=0).eval()
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        ref = model(x)
        low = model.to(torch.bfloat16)(x).float()
    assert (low - ref).abs().max() < 0.1
