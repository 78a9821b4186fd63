"""HuggingFace export/import: same logits, or the round-trip is exact."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from common.errors import ConfigError
from model import preset
from model.flops import flops_per_token
from model.hf import export_hf
from model.hf_format import import_hf
from model.layers import rope_inv_freq
from model.transformer import build_model

V, T = 101, 32


def briefly_trained(model, steps=5):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        x = torch.randint(0, V, (4, T))
        loss = model(x[:, :-1], labels=x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize(
    "variant, trained, kw",
    [
        ("standard", False, {}),
        ("standard", True, {}),
        ("standard", True, {"tie_embeddings": True, "num_kv_heads": 2, "bias": True, "rope_theta": 500000.0}),
        ("frozen_qk", True, {}),
        ("frozen_mlp", True, {"num_kv_heads": 1}),
    ],
)
def test_llama_export_gives_same_logits(tmp_path, variant, trained, kw):
    model = build_model(preset("tiny", variant=variant, vocab_size=V, max_seq_len=T, **kw), seed=0)
    if trained:
        briefly_trained(model)
    export_hf(model.eval(), tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, V, (3, T))
    with torch.no_grad():
        assert torch.equal(model(x), hf(x).logits)  # fp32: max abs diff 0, as the README says
    again = import_hf(tmp_path).eval()  # our config (variant, freezing) comes back too
    assert again.cfg == model.cfg
    assert [p.requires_grad for p in again.parameters()] == [p.requires_grad for p in model.parameters()]


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True, "num_kv_heads": 2}])
def test_mixit_round_trips_through_registered_class(tmp_path, kw):
    model = briefly_trained(build_model(preset("tiny", variant="mixit", vocab_size=V, max_seq_len=T, **kw), seed=0))
    export_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no trust_remote_code
    assert type(hf).__name__ == "TrainablePartsForCausalLM"
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        assert torch.equal(model(x), hf(x).logits)
        assert torch.equal(model(x), import_hf(tmp_path).eval()(x))


def test_import_plain_hf_llama(tmp_path):
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        rms_norm_eps=1e-5,
    )
    hf = LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = import_hf(tmp_path, variant="frozen_qk").eval()  # freeze Q/K of a pretrained Llama
    assert ours.cfg.variant == "frozen_qk" and not ours.layers[0].self_attn.q_proj.weight.requires_grad
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x).logits)


def test_import_refuses_pickle_only_dirs(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 10, "hidden_size": 8, '
        '"intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}'
    )
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        import_hf(tmp_path)


def test_import_refuses_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type"):
        import_hf(tmp_path)


# Llama-3.1's RoPE scaling numbers; Llama-3.2 differs only in factor (32).
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_reference(cfg):
    """Meta's apply_scaling from the Llama-3.1 release, per frequency in float64."""
    rs = cfg.rope_scaling
    old, low, high, factor = (
        rs["original_max_position_embeddings"],
        rs["low_freq_factor"],
        rs["high_freq_factor"],
        rs["factor"],
    )
    out = []
    for i in range(0, cfg.head_dim, 2):
        freq = 1.0 / cfg.rope_theta ** (i / cfg.head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(freq)
        elif wavelen > old / low:
            out.append(freq / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


# original_max_position_embeddings 8192 is Llama-3.1's own; 64 puts all three bands (kept, interpolated,
# divided by factor) inside this test's 128 positions, so a wrong band changes the logits there.
@pytest.mark.parametrize(
    "scaling", [LLAMA31_SCALING, {**LLAMA31_SCALING, "factor": 32.0, "original_max_position_embeddings": 64}]
)
def test_llama3_rope_scaling_matches_transformers(tmp_path, scaling):
    cfg = preset(
        "tiny",
        vocab_size=V,
        max_seq_len=128,
        num_kv_heads=2,
        tie_embeddings=True,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling=scaling,
    )
    ours = rope_inv_freq(cfg)
    hf_cfg = LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={**scaling, "rope_theta": cfg.rope_theta},
    )
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert attention_factor == 1.0 and torch.equal(ours, theirs)
    torch.testing.assert_close(ours.double(), llama3_reference(cfg), rtol=1e-6, atol=0)
    old = scaling["original_max_position_embeddings"]
    if old == 64:  # every band is exercised
        unscaled = rope_inv_freq(cfg.replace(rope_scaling=None))
        assert (ours == unscaled).any() and (ours == unscaled / scaling["factor"]).any()
        assert ((ours != unscaled) & (ours != unscaled / scaling["factor"])).any()

    model = briefly_trained(build_model(cfg, seed=0))
    export_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"] == {
        **scaling,
        "rope_theta": cfg.rope_theta,
    }
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, V, (3, cfg.max_seq_len))
    with torch.no_grad():
        logits = model(x)
        assert torch.equal(logits, hf(x).logits)  # fp32, max abs diff 0
        plain = LlamaForCausalLM.from_pretrained(
            tmp_path, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}
        ).eval()
        if old == 64:  # the scaling matters at these positions: ignoring it would be caught
            assert not torch.allclose(logits, plain(x).logits, atol=1e-4)
    again = import_hf(tmp_path).eval()
    assert again.cfg == model.cfg
    with torch.no_grad():
        assert torch.equal(again(x), logits)


@pytest.mark.parametrize("legacy", [False, True])
def test_import_plain_llama31_checkpoint(tmp_path, legacy):
    """A Llama-3.1-shaped checkpoint written by transformers itself (no trainable_parts entry) imports
    with the same logits; `legacy` rewrites config.json the way transformers 4.x wrote it (rope_scaling)."""
    torch.manual_seed(0)
    scaling = {**LLAMA31_SCALING, "original_max_position_embeddings": 64}
    hf_cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters={**scaling, "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    hf = LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    if legacy:
        raw = json.loads((tmp_path / "config.json").read_text())
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
        (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = import_hf(tmp_path).eval()
    assert ours.cfg.rope_scaling == scaling and ours.cfg.rope_theta == 500000.0
    x = torch.randint(0, V, (2, 128))
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x).logits)


@pytest.mark.parametrize(
    "rope",
    [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0}, {"type": "dynamic", "factor": 2.0}],
)
def test_import_refuses_other_rope_scalings(tmp_path, rope):
    raw = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 10000.0,
        "rope_scaling": rope,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        import_hf(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "not supported" in msg and "Fix:" in msg and "llama3" in msg
    assert repr(rope.get("rope_type", rope.get("type"))) in msg


def test_rope_scaling_leaves_flops_alone_and_is_refused_for_mixit():
    cfg = preset("tiny", vocab_size=V, max_seq_len=T)
    assert flops_per_token(cfg.replace(rope_scaling=LLAMA31_SCALING)) == flops_per_token(cfg)
    with pytest.raises(ConfigError, match="model.rope_scaling: MixiT has no rotary embedding.*Fix:"):
        preset("tiny", variant="mixit", rope_scaling=LLAMA31_SCALING)
