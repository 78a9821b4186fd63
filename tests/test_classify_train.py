"""Classification through the DeepSpeed trainer and the eval harness: learns the generated data,
fine-tunes from a pretrained LM checkpoint, and refuses what it does not support."""

from __future__ import annotations

import pytest
import torch

from checkpoint import load_for_eval
from common.errors import RecipeError
from data_pipeline.classification import make_toy_dataset
from eval.run import evaluate_run
from pretrain.config import load_recipe
from pretrain.train import train

RECIPE = "recipes/classify_toy_cpu.yaml"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_dataset(tmp_path_factory.mktemp("cls") / "toy.jsonl", n=1200, seed=0)


def test_classifier_learns_generated_data_well_above_chance(toy, tmp_path):
    over = [
        f"data.source=classify:{toy}",
        "train.max_steps=90",
        "train.seq_len=48",
        "train.eval_every_steps=0",
        "checkpoint.every_steps=30",
    ]
    res = train(RECIPE, over, run_dir=tmp_path, resume="never")
    assert res.final_step == 90
    rows = evaluate_run(tmp_path, ["classification"])
    assert [r["checkpoint"]["step"] for r in rows] == [30, 60, 90]
    last = rows[-1]["tasks"]["classification"]
    assert last["samples"] == 120 and 0.4 < last["majority_acc"] < 0.6
    assert last["acc"] >= 0.85, rows  # chance is ~0.5
    assert last["loss"] < rows[0]["tasks"]["classification"]["loss"]
    model, meta = load_for_eval(tmp_path)
    assert type(model).__name__ == "SequenceClassifier" and meta["step"] == 90
    assert not model.cfg.causal


def test_fine_tune_from_a_pretrained_lm_checkpoint(toy, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(["the food was great and the staff friendly"] * 200))
    lm = {
        "name": "lm",
        "model": {"preset": "tiny", "variant": "frozen_qk"},
        "data": {"source": f"text:{text}"},
        "train": {
            "seq_len": 48,
            "global_batch_sequences": 4,
            "micro_batch_sequences": 4,
            "max_steps": 3,
            "device": "cpu",
        },
        "parallel": {"ds_config": "cpu"},
        "logging": {"tensorboard": False},
    }
    train(lm, run_dir=tmp_path / "lm", resume="never")
    pre, _ = load_for_eval(tmp_path / "lm")
    over = [
        f"data.source=classify:{toy}",
        "train.max_steps=2",
        "train.seq_len=48",
        "train.eval_every_steps=0",
        f"classification.init_from={tmp_path / 'lm'}",
        "model={causal: false}",
        "train.lr=0.0",
        "optim.min_lr=0.0",
    ]
    train(RECIPE, over, run_dir=tmp_path / "cls", resume="never")
    clf, meta = load_for_eval(tmp_path / "cls")
    assert clf.cfg.variant == "frozen_qk" and not clf.cfg.causal  # the checkpoint's config + overrides
    for name, t in pre.state_dict().items():  # lr 0: the backbone is the pretrained one
        torch.testing.assert_close(clf.model.state_dict()[name], t)


@pytest.mark.parametrize(
    "over,msg",
    [
        (["parallel.pipeline_stages=2"], "pipeline"),
        (["classification.poolng=mean"], "unknown keys"),
        (["classification.pooling=max"], "pooling"),
        (["task=lm"], "task"),
        (["data.source=synthetic:kv_retrieval"], "classify:"),
    ],
)
def test_recipe_errors(over, msg):
    with pytest.raises(RecipeError, match=msg):
        load_recipe(RECIPE, over)
