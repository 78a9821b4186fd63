"""A lab's own probe, end to end: a tiny model trained on a text file of examples (one per line,
`documents: lines`, `windows: documents`) through the trainer's `text:` reader, then scored with
`exact_match:FILE.jsonl` by eval.run, over the run dir, and through the lm-eval adapter; its answers
are known, so the scores are too. Also the byte tokenizer's round trip trainer -> eval.generate ->
text, and perplexity of a text-trained run without --tokenizer."""

from __future__ import annotations

import json

import pytest

from common.errors import EvalError
from eval import generate as gen
from eval import run as ev
from eval.exact_match import Record, prediction, score
from eval.loading import load_checkpoint
from pretrain.train import train

PAIRS = {
    "cat": "meow",
    "dog": "woof",
    "cow": "moo",
    "owl": "hoot",
    "pig": "oink",
    "bee": "buzz",
    "hen": "cluck",
    "fox": "yip",
}
# Known answers of a model that memorised PAIRS (and ends every answer with EOS):
PROBES = [{"prompt": f"{k}=", "answer": v} for k, v in PAIRS.items()] + [
    {"prompt": "cat=", "answer": "woof"},  # wrong: it says meow (3rd character agrees)
    {"prompt": "cat=", "answer": "me", "stop": "o"},  # "meow" cut at its first "o"
    {"prompt": "cat=", "answer": "me", "stop": ["x", "y"]},  # wrong: "meow" goes on past "me"
    {"prompt": "dog=", "answer": "woof", "stop": "\n"},  # EOS ends the answer too
]
EXACT = 10 / 12
CHAR_ACC = (11 + 1 / 4) / 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("em")
    (d / "train.txt").write_text("".join(f"{k}={v}\n" for _ in range(40) for k, v in PAIRS.items()))
    (d / "probes.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBES))
    recipe = {
        "name": "em",
        "seed": 0,
        "model": {"preset": "tiny", "variant": "standard"},
        "data": {
            "source": f"text:{d / 'train.txt'}",
            "documents": "lines",
            "windows": "documents",
            "val_fraction": 0.0,
        },
        "train": {
            "seq_len": 32,
            "global_batch_sequences": 16,
            "micro_batch_sequences": 16,
            "max_steps": 120,
            "device": "cpu",
            "eval_every_steps": 0,
        },
        "optim": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 10},
        "parallel": {"ds_config": "cpu"},
        "checkpoint": {"every_steps": 60, "keep_last": 3},
        "logging": {"every_steps": 20, "tensorboard": False, "progress_bar": "off"},
    }
    train(recipe, run_dir=d / "run", resume="never")
    return d


def test_scoring_rules():
    r = Record("p", "46", ("\n",), 1)
    assert prediction("46\n7", r) == "46" and prediction("467\n", r) == "467"
    assert prediction("4", Record("p", "46", (), 1)) == "4" and prediction("469", Record("p", "46", (), 1)) == "46"
    assert score("47", "46") == (False, [True, False]) and score("", "ab") == (False, [False, False])


def test_bad_probe_files_are_refused_before_the_model(tmp_path):
    for text, msg in [
        ('{"prompt": "a"}\n', r"x\.jsonl:1: expected"),
        ("not json\n", "x.jsonl:1: not a JSON"),
        ('{"prompt": "a", "answer": "b", "stop": 3}\n', "stop must be"),
        ("\n", "holds no records"),
    ]:
        (tmp_path / "x.jsonl").write_text(text)
        with pytest.raises(EvalError, match=msg):
            ev.validate_tasks([f"exact_match:{tmp_path / 'x.jsonl'}"])
    with pytest.raises(EvalError, match="does not exist"):
        ev.validate_tasks([f"exact_match:{tmp_path / 'nope.jsonl'}"])


def test_exact_match_scores_the_known_answers(run, tmp_path, capsys):
    out = tmp_path / "res.json"
    assert (
        ev.main(
            [
                "--checkpoint",
                str(run / "run"),
                "--tasks",
                f"exact_match:{run / 'probes.jsonl'}",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )  # no --tokenizer: the run's own (bytes)
    res = json.loads(out.read_text())
    assert res["checkpoint"]["tokenizer_used"] == "bytes"
    r = res["tasks"]["exact_match:probes"]
    assert r["samples"] == 12 and r["exact_match"] == pytest.approx(EXACT)
    assert r["char_acc"] == pytest.approx(CHAR_ACC)
    assert r["by_position"] == {
        "1": pytest.approx(11 / 12),
        "2": pytest.approx(11 / 12),
        "3": 1.0,
        "4": 7 / 8,
        "5": 1.0,
    }
    assert [(e["line"], e["prediction"]) for e in r["errors"]] == [(9, "meow"), (11, "meow")]


def test_lm_eval_adapter_gives_the_same_scores(run):
    from eval.lm_eval_adapter import TrainablePartsLM, run_lm_eval

    lm = TrainablePartsLM(checkpoint=str(run / "run"), batch_size=4)  # tokenizer: the checkpoint's
    res = run_lm_eval(lm, [f"exact_match:{run / 'probes.jsonl'}"])["exact_match_probes"]
    assert res["exact_match"] == pytest.approx(EXACT) and res["char_acc"] == pytest.approx(CHAR_ACC)


def test_run_dir_reports_exact_match_per_step(run, tmp_path):
    task = f"exact_match:{run / 'probes.jsonl'}"
    assert (
        ev.main(["--run-dir", str(run / "run"), "--tasks", task, "--out-dir", str(tmp_path / "rep"), "--no-progress"])
        == 0
    )
    results = run / "run" / "eval" / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["checkpoint"]["step"] for r in rows] == [60, 120]
    assert rows[-1]["metrics"]["exact_match:probes/exact_match"] == pytest.approx(EXACT)
    assert "exact_match:probes/exact_match" in (tmp_path / "rep" / "results.md").read_text()
    assert (tmp_path / "rep" / "plots" / "exact_match_probes_exact_match.png").stat().st_size > 1000
    ev.main(["--run-dir", str(run / "run"), "--tasks", task, "--out-dir", str(tmp_path / "rep"), "--no-progress"])
    assert len(results.read_text().splitlines()) == 2  # done already: skipped
    with open(run / "probes.jsonl", "a") as f:  # an edited probe file is scored again
        f.write(json.dumps({"prompt": "owl=", "answer": "hoot"}) + "\n")
    try:
        ev.main(["--run-dir", str(run / "run"), "--tasks", task, "--out-dir", str(tmp_path / "rep"), "--no-progress"])
        assert len(results.read_text().splitlines()) == 4
    finally:
        (run / "probes.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBES))


def test_round_trip_trainer_to_generate_to_text(run, capsys):
    ck = str(run / "run")
    assert gen.main(["--checkpoint", ck, "--prompt", "dog=", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == "dog=woof\n"  # greedy, stopped at EOS, decoded without it
    assert gen.main(["--checkpoint", ck, "--tokenizer", "bytes", "--prompt", "hen=", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "hen=cluck\n"  # --temperature 0 is greedy
    _, info = load_checkpoint(ck)  # the checkpoint records the recipe's data section and the tokenizer
    assert (info["tokenizer_id"], info["meta"]["data"]["documents"]) == ("bytes", "lines")


def test_generate_help_says_greedy(capsys):
    with pytest.raises(SystemExit):
        gen.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Decoding is greedy" in text and "default: greedy decoding" in text


def test_perplexity_of_a_text_run_without_and_with_tokenizer(run, tmp_path):
    text = tmp_path / "val.txt"
    text.write_text("".join(f"{k}={v}\n" for k, v in PAIRS.items()))
    outs = []
    for extra in ([], ["--tokenizer", "bytes"]):
        out = tmp_path / f"p{len(extra)}.json"
        assert (
            ev.main(
                [
                    "--checkpoint",
                    str(run / "run"),
                    "--tasks",
                    "perplexity",
                    "--text",
                    str(text),
                    "--out",
                    str(out),
                    "--no-progress",
                    *extra,
                ]
            )
            == 0
        )
        outs.append(json.loads(out.read_text()))
    assert outs[0]["checkpoint"]["tokenizer_used"] == outs[1]["checkpoint"]["tokenizer_used"] == "bytes"
    assert outs[0]["tasks"]["perplexity"]["loss"] == outs[1]["tasks"]["perplexity"]["loss"]
