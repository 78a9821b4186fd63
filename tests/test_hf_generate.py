"""Generation in plain transformers: every variant's export, loaded with AutoModelForCausalLM after
`import model.hf`, generates greedily what eval.generate generates from the checkpoint it came from; and an
export of a variant transformers does not know does so with the modelling code it ships, in a process
without this repository."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from fixtures import make_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.dynamic_module_utils import get_imports

import model.hf  # noqa: F401  (registers TrainablePartsForCausalLM, as a user's script does)
from data_pipeline.tokenizer import load_tokenizer
from eval.generate import generate
from eval.loading import load_checkpoint
from model import preset
from model.hf import export_hf
from model.io import save_native
from model.transformer import build_model
from pretrain.export import export

V, T = 101, 32
PROMPT = [5, 17, 3, 42, 8]


def briefly_trained(model, steps=5):
    """A few steps at a high rate: peaked logits, so greedy decoding has no near-ties."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, V, (4, T), generator=gen)
        loss = model(x[:, :-1], labels=x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def exported(tmp_path, variant, **kw):
    """(the checkpoint as eval loads it, the HF export as transformers loads it), through pretrain.export."""
    model = briefly_trained(build_model(preset("tiny", variant=variant, vocab_size=V, max_seq_len=T, **kw), seed=0))
    save_native(model, tmp_path / "native", {"step": 5})
    export(tmp_path / "native", tmp_path / "hf", "hf")
    ours, _ = load_checkpoint(tmp_path / "native")
    return ours, AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()


@pytest.mark.parametrize(
    "variant, kw, cls",
    [
        ("standard", {}, "LlamaForCausalLM"),
        ("frozen_qk", {}, "LlamaForCausalLM"),
        ("frozen_mlp", {"num_kv_heads": 1}, "LlamaForCausalLM"),
        ("random_transformer", {}, "LlamaForCausalLM"),
        ("mixit", {}, "TrainablePartsForCausalLM"),  # values-only cache
        ("mixit", {"num_kv_heads": 2, "tie_embeddings": True}, "TrainablePartsForCausalLM"),
        ("shaped", {}, "TrainablePartsForCausalLM"),
        ("standard", {"parametrization": "mup"}, "TrainablePartsForCausalLM"),  # µP is not a Llama
    ],
)
def test_export_generates_what_eval_generate_generates(tmp_path, variant, kw, cls):
    ours, hf = exported(tmp_path, variant, **kw)
    assert type(hf).__name__ == cls
    want = generate(ours, PROMPT, 20)  # greedy, with our own cache
    assert want == generate(ours, PROMPT, 20, use_cache=False)
    x = torch.tensor([PROMPT])
    assert hf.generate(x, max_new_tokens=20, do_sample=False)[0, len(PROMPT) :].tolist() == want
    assert hf.generate(x, max_new_tokens=20, do_sample=False, use_cache=False)[0, len(PROMPT) :].tolist() == want


@pytest.mark.parametrize("variant", ["standard", "mixit"])
def test_export_stops_at_the_tokenizers_eos_as_eval_generate_does(tmp_path, variant):
    ours, _ = exported(tmp_path, variant)
    eos = generate(ours, PROMPT, 20)[3]  # a token greedy decoding reaches: the end of document here
    want = generate(ours, PROMPT, 20, eos_id=eos)
    assert want[-1] == eos and len(want) < 20
    export_hf(ours, tmp_path / "hf_eos", eos_id=eos)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_eos").eval()
    assert hf.generation_config.eos_token_id == eos
    assert hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False)[0, len(PROMPT) :].tolist() == want


@pytest.mark.parametrize("variant", ["mixit", "shaped"])
def test_cache_is_transformers_own_and_a_padded_batch_gives_each_row_alone(tmp_path, variant):
    ours, hf = exported(tmp_path, variant)
    steps = []
    hf.model.register_forward_pre_hook(lambda module, args: steps.append(args[0].shape[1]))
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert steps == [len(PROMPT), 1, 1, 1] and cache.get_seq_length() == len(PROMPT) + 3  # one token a step
    short = [9, 4]
    ids = torch.tensor([PROMPT, [0] * 3 + short])  # left padding, as lm-eval's hf model batches prompts
    mask = torch.tensor([[1] * 5, [0] * 3 + [1] * 2])
    rows = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert rows[:, len(PROMPT) :].tolist() == [generate(ours, PROMPT, 8), generate(ours, short, 8)]


def test_bidirectional_export_generates_without_a_cache(tmp_path):
    """Every new token changes a bidirectional model's earlier positions: it recomputes the sequence."""
    ours, hf = exported(tmp_path, "standard", causal=False)
    want = generate(ours, PROMPT, 12, use_cache=False)
    assert hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, 5:].tolist() == want


def test_autotokenizer_loads_a_mixit_export_without_the_model_type_warning(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tok_dir)
    model = build_model(preset("tiny", variant="mixit", vocab_size=tok.vocab_size, max_seq_len=T), seed=0)
    save_native(model, tmp_path / "native", {"tokenizer_id": tok.identity, "tokenizer_path": str(tok_dir)})
    export(tmp_path / "native", tmp_path / "hf", "hf")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [r.getMessage() for r in seen if "model of type" in r.getMessage()]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").generation_config.eos_token_id == tok.eos_id
    assert hf_tok(" the river", add_special_tokens=False)["input_ids"] == tok.encode(" the river")


# A process with torch and transformers and none of this repository: no site processing (so no editable
# install of the project), only the site-packages directories of this environment on the path, run from
# another directory.
WITHOUT_REPOSITORY = """
import importlib.util, json, sys
sys.path[:0] = json.loads(sys.argv[1])
assert importlib.util.find_spec("model") is None and importlib.util.find_spec("common") is None, "the repository is importable"
import torch
from transformers import AutoModelForCausalLM
prompt, out = json.loads(sys.argv[2]), {}
for d in sys.argv[3:]:
    hf = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    out[d] = [type(hf).__module__, ids[0, len(prompt) :].tolist()]
print(json.dumps(out))
"""


def test_an_export_ships_its_modelling_code_and_generates_without_this_repository(tmp_path):
    """MixiT (its matrix regenerated from the seed by the shipped Philox code), shaped and bidirectional
    exports carry their code (`auto_map`): transformers loads them with trust_remote_code where `import
    model` fails, and they generate what eval.generate generates from their checkpoints."""
    cases = {
        "mixit": ("mixit", {"num_kv_heads": 2, "tie_embeddings": True}),
        "shaped": ("shaped", {}),
        "bidirectional": ("standard", {"causal": False}),
    }
    want = {}
    for name, (variant, kw) in cases.items():
        ours, _ = exported(tmp_path / name, variant, **kw)
        config = json.loads((tmp_path / name / "hf" / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_trainable_parts.TrainablePartsForCausalLM"
        # what transformers asks of a remote file (on the Hub, of every file): packages it names, GPU ones too
        for f in (tmp_path / name / "hf").glob("*.py"):
            asked = set(get_imports(f)) - set(sys.stdlib_module_names)
            assert asked <= {"torch", "transformers", "safetensors"}, (f.name, asked)
        want[str(tmp_path / name / "hf")] = generate(ours, PROMPT, 12, use_cache=ours.cfg.causal)
    site = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")  # where transformers copies remote code
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", WITHOUT_REPOSITORY, json.dumps(site), json.dumps(PROMPT), *want],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    for d, tokens in want.items():
        module, ids = got[d]
        assert module.startswith("transformers_modules.") and module.endswith(".modeling_trainable_parts"), module
        assert ids == tokens, d


def test_a_llama_export_ships_no_code(tmp_path):
    exported(tmp_path, "frozen_qk")
    assert "auto_map" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert not list((tmp_path / "hf").glob("*.py"))


@pytest.mark.parametrize("variant", ["mixit", "shaped"])
def test_generation_past_max_seq_len_stops_where_the_context_is_full_with_one_line(tmp_path, variant, caplog):
    """Asked for more tokens than fit, eval.generate and the export's generate() stop at the same length
    (max_seq_len + 1 tokens in all) and each says so in one line; MixiT's generate() used to raise."""
    ours, hf = exported(tmp_path, variant)
    fit = T + 1 - len(PROMPT)
    with caplog.at_level(logging.WARNING):
        want = generate(ours, PROMPT, 40)
    assert len(want) == fit
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"generate: 40 new tokens asked, {fit} fit after a prompt of 5 tokens in the model's max_seq_len={T}; generation stops there"
    ]
    x = torch.tensor([PROMPT])
    for ask in ({"max_new_tokens": 40}, {"max_length": 45}):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            got = hf.generate(x, do_sample=False, **ask)[0, len(PROMPT) :].tolist()
        assert got == want
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == said
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # what fits is generated without a word
        assert hf.generate(x, max_new_tokens=fit, do_sample=False)[0, len(PROMPT) :].tolist() == want
        assert generate(ours, PROMPT, fit) == want
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
