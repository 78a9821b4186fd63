"""ModelConfig validation (one test per rule) and the size ladder's parameter counts."""

import pytest
import torch

from common.errors import ConfigError
from model import PRESETS, ModelConfig, param_count, preset
from model.transformer import build_model


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(hidden_size=100, num_heads=8), "hidden_size"),
        (dict(hidden_size=96, num_heads=32), "num_heads"),  # head dim 3 is odd
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(variant="mixt"), "variant"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(max_seq_len=-1), "max_seq_len"),
        (dict(num_layers=2.5), "num_layers"),
        (dict(variant="mixit", max_seq_len=50000), "max_seq_len"),
        (dict(variant="mixit", mixit_residual_scale=1.5), "mixit_residual_scale"),
        (dict(mixit_seed=-3), "mixit_seed"),
        (dict(attn_impl="cuda"), "attn_impl"),
        (dict(mixit_impl="fast"), "mixit_impl"),
        (dict(frozen_groups=["qkv"]), "frozen_groups"),
        (dict(freeze_schedule=[[10, ["qk"]], [5, []]]), "freeze_schedule"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),  # keys missing
        (
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192,
                }
            ),
            "rope_scaling",
        ),  # bands inverted
        (
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 81.92,
                }
            ),
            "rope_scaling",
        ),
    ],
)
def test_bad_config_names_field_and_fix(kwargs, field):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kwargs)
    msg = str(err.value)
    assert f"model.{field}" in msg and "Fix:" in msg


def test_mixit_impl_streamed_is_allowed_and_a_bad_value_still_names_the_choices():
    assert ModelConfig(variant="mixit", mixit_impl="streamed").mixit_impl == "streamed"
    with pytest.raises(ConfigError) as err:
        ModelConfig(variant="mixit", mixit_impl="stream")
    msg = str(err.value)
    assert "model.mixit_impl" in msg and "'stream'" in msg and "Fix:" in msg
    assert "'streamed'" in msg and "'triton'" in msg


def test_close_match_hints():
    with pytest.raises(ConfigError, match="did you mean 'mixit'"):
        ModelConfig(variant="mixt")
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        ModelConfig.from_dict({"hiden_size": 64})
    with pytest.raises(ConfigError, match="did you mean 'qk'"):
        ModelConfig(frozen_groups=["qkk"])


def test_schedule_resolution():
    cfg = ModelConfig(variant="frozen_qk", freeze_schedule=[[100, []], [200, ["mlp"]]])
    assert cfg.frozen_groups_at(0) == {"qk"}
    assert cfg.frozen_groups_at(99) == {"qk"}
    assert cfg.frozen_groups_at(100) == set()
    assert cfg.frozen_groups_at(250) == {"mlp"}
    assert cfg.schedule_boundaries() == [100, 200]


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("variant", ["standard", "mixit"])
def test_param_count_formula_matches_modules(name, variant):
    cfg = preset(name, variant=variant)
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)["total"]


def test_param_count_matches_published_llama3_sizes():
    # Published parameter counts of Llama-3.2-1B, Llama-3.2-3B and Llama-3-8B.
    assert param_count(preset("1b"))["total"] == 1_235_814_400
    assert param_count(preset("3b"))["total"] == 3_212_749_824
    assert param_count(preset("8b"))["total"] == 8_030_261_248


def test_biases_counted():
    cfg = preset("tiny", bias=True)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)["total"]
