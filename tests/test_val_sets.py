"""A corpus of several sources to shards and named validation sets: a tokenizer trained on the
train JSONL, `prepare --where source=...` per source, and the trainer's `val_loss/<name>` per set
with `val_loss` pooled over their tokens, checked against the model evaluated by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from fixtures import SOURCES, source_corpus

from checkpoint import load_for_eval
from common.errors import DataError, RecipeError
from data_pipeline.prepare import prepare
from data_pipeline.shards import ShardSet, read_manifest
from data_pipeline.tokenizer import train_sentencepiece
from eval.loading import load_tokenizer
from eval.perplexity import perplexity, shard_stream
from eval.run import main as eval_main
from pretrain.train import train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return source_corpus(tmp_path_factory.mktemp("corpus"))


def test_tokenizer_from_jsonl_and_prepare_where(corpus):
    root, tok, sets = corpus
    meta = json.loads((tok / "tokenizer_meta.json").read_text())
    assert meta["vocab_size"] == 320 and not list(tok.glob("*.tmp*"))
    docs = [json.loads(line) for line in (root / "valid.jsonl").read_text().splitlines()]
    for source, d in sets.items():
        m = read_manifest(d)
        assert m["num_docs"] == sum(doc["source"] == source for doc in docs) == 10
        assert m["config"]["where"] == {"source": source}
    # the filtered sets partition the unfiltered file's tokens
    whole = prepare(root / "valid.jsonl", tok, root / "valid-all", progress=False)
    assert whole["num_tokens"] == sum(read_manifest(d)["num_tokens"] for d in sets.values())
    with pytest.raises(DataError, match="no record .* has"):
        prepare(root / "valid.jsonl", tok, root / "none", progress=False, where=["source=nope"])
    with pytest.raises(DataError, match="do not have"):
        prepare(root / "valid.jsonl", tok, root / "none", progress=False, where=["lang=en"])
    with pytest.raises(DataError, match="FIELD=VALUE"):
        prepare(root / "valid.jsonl", tok, root / "none", progress=False, where=["source"])


def _set_loss(model, directory: str, seq_len: int) -> tuple[float, int]:
    """(summed cross-entropy, tokens) over every full window of a set, by a plain forward pass."""
    shards = ShardSet(directory, read_manifest(directory))
    n = (shards.num_tokens - 1) // seq_len
    toks = torch.from_numpy(shards.gather(np.arange(n, dtype=np.int64) * seq_len, seq_len + 1).astype(np.int64))
    with torch.no_grad():
        logits = model(toks[:, :-1])
        ce = torch.nn.functional.cross_entropy(
            logits.double().reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1), reduction="sum"
        )
    return float(ce), n * seq_len


def train_on_sets(root, sets, run, extra: list[str]) -> list[dict]:
    """4 steps on the corpus's shards with its per-source sets, evaluated every 2; the metrics records."""
    data = {"source": str(root / "train"), "val_fraction": 0, "val_sets": sets}
    over = [f"data={json.dumps(data)}", "train.max_steps=4", "train.eval_every_steps=2", "checkpoint.every_steps=0"]
    train("recipes/tiny_cpu.yaml", [*over, *extra], run_dir=run, resume="never")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_trainer_reports_loss_per_named_set_and_pooled(corpus, tmp_path):
    root, tok, sets = corpus
    run = tmp_path / "run"
    recs = train_on_sets(root, sets, run, ["model.variant=standard", "train.eval_batches=100"])
    evals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    last = evals[-1]
    per_set = {name: last[f"val_loss/{name}"] for name in SOURCES}
    assert len({round(v, 4) for v in per_set.values()}) == 3  # the sources differ

    model, _ = load_for_eval(run)
    model.eval()
    sums = {name: _set_loss(model, d, 32) for name, d in sets.items()}
    for name, (ce, n) in sums.items():
        assert per_set[name] == pytest.approx(ce / n, rel=1e-4), name
    pooled = sum(ce for ce, _ in sums.values()) / sum(n for _, n in sums.values())
    assert last["val_loss"] == pytest.approx(pooled, rel=1e-4)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tb"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("val/loss/code")] == [2, 4]


def test_val_sets_refused_early(corpus, tmp_path):
    root, tok, sets = corpus
    bad = {"source": str(root / "train"), "val_sets": {"a/b": sets["code"]}}
    with pytest.raises(DataError, match="letters, digits"):
        train("recipes/tiny_cpu.yaml", [f"data={json.dumps(bad)}"], run_dir=tmp_path / "r1", resume="never")
    other = tmp_path / "tok2"
    train_sentencepiece([str(root / "valid.jsonl")], 300, other, quiet=True)
    prepare(root / "valid.jsonl", other, tmp_path / "v2", progress=False)
    mismatch = {"source": str(root / "train"), "val_sets": {"x": str(tmp_path / "v2")}}
    with pytest.raises(RecipeError, match="records tokenizer .* Fix: prepare the validation set"):
        train("recipes/tiny_cpu.yaml", [f"data={json.dumps(mismatch)}"], run_dir=tmp_path / "r2", resume="never")
    assert not (tmp_path / "r2" / "metrics.jsonl").exists()


def test_eval_tasks_during_training_are_recipe_keys(corpus, tmp_path):
    """`eval.tasks` runs bits per byte on every named set, the induction score and an exact-match file
    at the validation cadence, logged under eval/ to metrics.jsonl and TensorBoard; the last step's
    bits per byte are what eval's perplexity gives the saved model."""
    root, tok, sets = corpus
    prompts = tmp_path / "defs.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"noun verb {w}", "answer": " adj"}) + "\n" for w in SOURCES))
    run = tmp_path / "run"
    tasks = [
        f"eval.tasks=[bits_per_byte, induction, 'exact_match:{prompts}']",
        "eval.induction_lengths=[8]",
        "eval.n=4",
    ]
    recs = train_on_sets(root, sets, run, tasks)
    evals = [r for r in recs if "eval/bpb" in r]
    assert [r["step"] for r in evals] == [2, 4]
    last = evals[-1]
    assert 0.0 <= last["eval/exact_match/defs/exact_match"] <= 1.0 and 0.0 <= last["eval/induction/acc"] <= 1.0
    model, _ = load_for_eval(run)
    model.eval()
    tokenizer = load_tokenizer(str(tok))
    bits, nbytes = 0.0, 0
    for name, d in sets.items():
        toks, n_bytes = shard_stream(d, tokenizer)
        got = perplexity(model, toks, batch_size=8, n_bytes=n_bytes, progress=False)
        assert last[f"eval/bpb/{name}"] == pytest.approx(got["bits_per_byte"], rel=1e-5), name
        bits, nbytes = bits + got["loss"] * got["tokens"] / math.log(2), nbytes + n_bytes
    assert last["eval/bpb"] == pytest.approx(bits / nbytes, rel=1e-5)
    # eval.run: the same sets by name, one result each and one pooled over their tokens
    named = [f"--val-dir={name}={d}" for name, d in sets.items()]
    out = tmp_path / "ppl.json"
    assert (
        eval_main(["--checkpoint", str(run), "--tasks", "perplexity", *named, "--out", str(out), "--no-progress"]) == 0
    )
    res = json.loads(out.read_text())["tasks"]["perplexity"]
    assert {k: v["bits_per_byte"] for k, v in res.items() if k != "pooled"} == pytest.approx(
        {name: last[f"eval/bpb/{name}"] for name in sets}, rel=1e-5
    )
    assert res["pooled"]["bits_per_byte"] == pytest.approx(last["eval/bpb"], rel=1e-5)
    mixed = [named[0], f"--val-dir={sets['code']}"]  # a named set beside an unnamed one
    assert eval_main(["--checkpoint", str(run), "--tasks", "perplexity", *mixed]) == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tb"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("eval/bpb/code")] == [2, 4]


@pytest.mark.parametrize(
    "tasks, data_keys, match",
    [
        ("[perplexity]", {}, "unknown task 'perplexity'"),
        ("[bits_per_byte]", {"val_fraction": 0.1}, "data.val_sets names none"),
        ("['exact_match:nope.jsonl']", {"val_fraction": 0.1}, "nope.jsonl"),
    ],
)
def test_eval_tasks_refused_before_training(corpus, tmp_path, tasks, data_keys, match):
    root, _, sets = corpus
    data = {"source": str(root / "train"), "val_fraction": 0, "val_sets": sets, **data_keys}
    if "val_fraction" in data_keys:
        data.pop("val_sets")
    with pytest.raises(RecipeError, match=match):
        train(
            "recipes/tiny_cpu.yaml",
            [f"data={json.dumps(data)}", f"eval.tasks={tasks}", "train.eval_every_steps=2"],
            run_dir=tmp_path / "r",
            resume="never",
        )
    assert not (tmp_path / "r").exists()
