"""Cached generation (K+V for softmax variants, V only for MixiT) equals full recomputation."""

import pytest
import torch

from eval.generate import generate, main, sample_next
from model import VARIANTS, preset
from model.io import save_native
from model.transformer import build_model

torch.set_num_threads(1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_equals_uncached(variant):
    model = build_model(preset("tiny", variant=variant, vocab_size=97, max_seq_len=48), seed=1).eval()
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    a, la = generate(model, prompt, 30, return_logits=True)
    b, lb = generate(model, prompt, 30, use_cache=False, return_logits=True)
    assert a == b
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
    # sampling with the same seed: same draws from the same distributions
    a = generate(model, prompt[0], 20, top_k=10, top_p=0.9, temperature=0.8, seed=5)
    b = generate(model, prompt[0], 20, top_k=10, top_p=0.9, temperature=0.8, seed=5, use_cache=False)
    assert a == b
    if variant == "mixit":
        cache = model.new_cache()
        model(prompt, cache=cache)
        assert all(k is None for k in cache.k) and cache.length == 7  # values only


def test_generation_stops_at_max_seq_len():
    model = build_model(preset("tiny", vocab_size=31, max_seq_len=16), seed=0).eval()
    out = generate(model, [1, 2, 3], 100)
    assert len(out) == 16 - 3 + 1


def test_top_k_top_p_filtering():
    logits = torch.tensor([[5.0, 4.0, 1.0, -3.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, top_k=2, generator=g)) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample_next(logits, top_p=0.5, generator=g)) for _ in range(50)}
    assert draws == {0}
    assert int(sample_next(logits)) == 0


def test_generate_cli(tmp_path, capsys):
    model = build_model(preset("tiny", variant="mixit", vocab_size=257, max_seq_len=32), seed=0)
    save_native(model, tmp_path / "ck", {"step": 1, "tokenizer_id": "bytes"})
    assert (
        main(
            ["--checkpoint", str(tmp_path / "ck"), "--tokenizer", "bytes", "--prompt", "Hello", "--max-new-tokens", "5"]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("Hello")
    assert (
        main(["--checkpoint", str(tmp_path / "ck"), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--top-k", "5"])
        == 0
    )
