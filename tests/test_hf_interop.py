"""HuggingFace export/import: same logits, or the round-trip is exact."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from model import build_model, preset
from model.hf import export_hf, import_hf

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


@pytest.mark.parametrize("variant, trained, kw", [
    ("standard", False, {}),
    ("standard", True, {}),
    ("standard", True, {"tie_embeddings": True, "num_kv_heads": 2, "bias": True, "rope_theta": 500000.0}),
    ("frozen_qk", True, {}),
    ("frozen_mlp", True, {"num_kv_heads": 1}),
])
def test_llama_export_gives_same_logits(tmp_path, variant, trained, kw):
    model = build_model(preset("tiny", variant=variant, vocab_size=V, max_seq_len=T, **kw), seed=0)
    if trained:
        briefly_trained(model)
    export_hf(model.eval(), tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, V, (3, T))
    with torch.no_grad():
        diff = (model(x) - hf(x).logits).abs().max().item()
    assert diff <= 1e-5
    again = import_hf(tmp_path).eval()                 # our config (variant, freezing) comes back too
    assert again.cfg == model.cfg
    assert [p.requires_grad for p in again.parameters()] == [p.requires_grad for p in model.parameters()]


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True, "num_kv_heads": 2}])
def test_mixit_round_trips_through_registered_class(tmp_path, kw):
    model = briefly_trained(build_model(preset("tiny", variant="mixit", vocab_size=V, max_seq_len=T, **kw), seed=0))
    export_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()      # no trust_remote_code
    assert type(hf).__name__ == "TrainablePartsForCausalLM"
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        assert torch.equal(model(x), hf(x).logits)
        assert torch.equal(model(x), import_hf(tmp_path).eval()(x))


def test_import_plain_hf_llama(tmp_path):
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, rms_norm_eps=1e-5)
    hf = LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = import_hf(tmp_path, variant="frozen_qk").eval()          # freeze Q/K of a pretrained Llama
    assert ours.cfg.variant == "frozen_qk" and not ours.layers[0].self_attn.q_proj.weight.requires_grad
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max().item() <= 1e-5


def test_import_refuses_pickle_only_dirs(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 10, "hidden_size": 8, '
                                          '"intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}')
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        import_hf(tmp_path)


def test_import_refuses_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type"):
        import_hf(tmp_path)
