"""SequenceClassifier: pooling, padding, bidirectionality, freezing groups and the data loader's order."""

from __future__ import annotations

import pytest
import torch

from data_pipeline.classification import ClassificationLoader, make_toy_dataset
from data_pipeline.config import parse_data
from model import preset
from model.classifier import build_classifier
from model.mixit import mixing_matrix

VARIANTS = ["standard", "frozen_qk", "frozen_mlp", "mixit", "random_transformer", "shaped"]


def clf(variant="standard", causal=False, pooling="last", **kw):
    cfg = preset("tiny", vocab_size=32, max_seq_len=16, variant=variant, causal=causal, **kw)
    return build_classifier(cfg, num_labels=3, pooling=pooling, pad_id=0, seed=0).eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_bidirectional_head_sees_later_tokens_causal_last_does_not_need_them(variant):
    x = torch.randint(1, 32, (2, 10))
    y = x.clone()
    y[:, 3] = (y[:, 3] % 31) + 1  # change an early token
    z = x.clone()
    z[:, 9] = (z[:, 9] % 31) + 1  # change the last token
    bi = clf(variant, causal=False, pooling="mean")
    with torch.no_grad():
        assert bi(x).shape == (2, 3)
        # mean pooling over a bidirectional model: every position's state depends on every token
        h0 = bi.model(x, return_hidden=True)
        h1 = bi.model(z, return_hidden=True)
    assert not torch.allclose(h0[:, 0], h1[:, 0]), "bidirectional: position 0 must see the last token"
    ca = clf(variant, causal=True)
    with torch.no_grad():
        h0 = ca.model(x, return_hidden=True)
        h1 = ca.model(z, return_hidden=True)
    torch.testing.assert_close(h0[:, :9], h1[:, :9])  # causal: earlier positions never see later ones


@pytest.mark.parametrize("variant", ["standard", "frozen_qk", "random_transformer"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_right_padding_does_not_change_bidirectional_logits(variant, pooling):
    m = clf(variant, causal=False, pooling=pooling)
    x = torch.randint(1, 32, (1, 7))
    padded = torch.cat([x, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(m(x), m(padded), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_causal_last_pooling_ignores_right_padding_for_every_mixer(pooling):
    m = clf("mixit", causal=True, pooling=pooling)
    x = torch.randint(1, 32, (2, 6))
    padded = torch.cat([x, torch.zeros(2, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(m(x), m(padded), atol=1e-5, rtol=1e-5)


def test_pooling_picks_last_real_token_and_mean_of_real_tokens():
    m = clf(pooling="last")
    h = torch.arange(2 * 5 * 1, dtype=torch.float).view(2, 5, 1)
    ids = torch.tensor([[3, 4, 0, 0, 0], [5, 6, 7, 8, 9]])
    assert m.pool(h, ids).flatten().tolist() == [1.0, 9.0]
    m.pooling = "mean"
    assert m.pool(h, ids).flatten().tolist() == [0.5, 7.0]


def test_loss_is_mean_cross_entropy_and_ignores_minus_100():
    m = clf()
    x = torch.randint(1, 32, (4, 8))
    y = torch.tensor([0, 2, -100, 1])
    logits = m(x)
    want = torch.nn.functional.cross_entropy(logits[[0, 1, 3]], y[[0, 1, 3]])
    torch.testing.assert_close(m(x, y), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_freezing_groups_cover_the_head_and_lm_head_stays_frozen(variant):
    m = clf(variant)
    assert m.score.weight.requires_grad  # "head" group, trainable in every preset
    assert not m.model.lm_head.weight.requires_grad  # unused by classification
    names = {n for n, p in m.named_parameters() if not p.requires_grad}
    if variant == "frozen_qk":
        assert "model.layers.0.self_attn.q_proj.weight" in names
    if variant == "random_transformer":
        assert "model.layers.1.mlp.up_proj.weight" in names and "score.weight" not in names
    cfg = preset("tiny", vocab_size=32, max_seq_len=16, frozen_groups=["head"])
    m2 = build_classifier(cfg, 2, seed=0)
    assert not m2.score.weight.requires_grad


def test_mixit_bidirectional_rows_sum_to_one_at_several_lengths():
    cfg = preset("tiny", vocab_size=32, max_seq_len=32, variant="mixit", causal=False)
    for t in (1, 5, 17, 32):
        a = mixing_matrix(cfg, 0, t, torch.device("cpu"))
        torch.testing.assert_close(a[1:].sum(-1), torch.ones(a.shape[0] - 1, t), atol=1e-5, rtol=1e-5)
        assert t == 1 or bool((a[1:] != 0).triu(1).any()), "bidirectional rows must use later positions"


def test_loader_order_is_deterministic_resumable_and_world_size_independent(tmp_path):
    f = make_toy_dataset(tmp_path / "d.jsonl", 120, seed=1)
    data = parse_data({"source": f"classify:{f}", "seed": 3, "val_fraction": 0.1})
    one = ClassificationLoader(data, "train", 24, 8)
    seq = [next(one) for _ in range(20)]  # > one epoch (108 train examples)
    a, b = ClassificationLoader(data, "train", 24, 8, 0, 2), ClassificationLoader(data, "train", 24, 8, 1, 2)
    for k in range(5):
        ba, bb = next(a), next(b)
        torch.testing.assert_close(torch.cat([ba["labels"], bb["labels"]]), seq[k]["labels"])
        torch.testing.assert_close(torch.cat([ba["input_ids"], bb["input_ids"]]), seq[k]["input_ids"])
    r = ClassificationLoader(data, "train", 24, 8)
    r.load_state_dict(one.state_dict() | {"samples_seen": 8 * 13})
    torch.testing.assert_close(next(r)["input_ids"], seq[13]["input_ids"])
    val = ClassificationLoader(data, "val", 24, 8)
    assert val.n == 12 and len(one) == 108
    assert not set(map(tuple, val.input_ids.tolist())) & set(map(tuple, one.input_ids.tolist()))


def test_csv_with_string_labels(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("review,stars\n" + "".join(f'"good {i}",pos\n"bad {i}",neg\n' for i in range(10)))
    ld = ClassificationLoader(
        parse_data({"source": f"classify:{p}", "text_field": "review", "label_field": "stars", "val_fraction": 0.2}),
        "train",
        16,
        4,
    )
    assert ld.mapping == {"neg": 0, "pos": 1} and ld.num_labels == 2 and ld.n == 16
