"""The mechanism studies at a tiny budget (the pipelines only; the measurements are docs/RESULTS.md's):
induction probes logged during training and plotted, and the packed-arithmetic layouts."""

from __future__ import annotations

import json
import random

import pytest
import torch

from model import preset
from model.transformer import build_model
from studies import induction, packed
from studies.rows import read_rows


def test_induction_study_logs_probes_during_training_and_reports(tmp_path):
    out, text = tmp_path / "ind", tmp_path / "text"
    text.mkdir()  # the recipe's WikiText-2 comes from the Hub (no network here): generated text in its place
    rng = random.Random(0)
    words = "the of and to in a is that for it as was with be by on not he this are or his from at river city".split()
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + " ." for _ in range(1500))
    (text / "train.txt").write_text("\n".join(lines) + "\n")
    assert (
        induction.main(
            [
                "--smoke",
                "--out",
                str(out),
                "--variants",
                "standard,mixit",
                "--seeds",
                "1",
                "--vocab-size",
                "320",
                "--repeat-fraction",
                "0.5",
                "--rows",
                str(tmp_path / "rows.jsonl"),
                f"data.source=text:{text}",
            ]
        )
        == 0
    )
    rows = [json.loads(x) for x in (out / "runs" / "standard-L2-s0" / "metrics.jsonl").read_text().splitlines()]
    probed = [r for r in rows if "probe/icl_score" in r]
    assert [r["step"] for r in probed] == [2, 4]  # every eval_every_steps, in metrics.jsonl
    assert len(probed[-1]["probe/induction_score_text_heads"]) == 2  # [layer][head]
    mix = [json.loads(x) for x in (out / "runs" / "mixit-L2-s0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["probe/source"] for r in mix if "probe/source" in r] == ["mixing_matrix"] * 2
    md = (out / "induction.md").read_text()
    assert "| standard | 2 | 1 | 4 |" in md and "| mixit | 2 | 1 | 4 |" in md and "(fixed map)" in md
    assert (out / "induction.png").stat().st_size > 10_000
    # the held-out documents are the shards' tail, and the bursty copies only ever come from training text
    data = out / "data"
    held = (data / "bpe320_repeat0.5x400_heldout.txt").read_text()
    full = (data / "bpe320_repeat0.5x400.txt").read_text()
    assert full.endswith(held) and full.count("\n") > held.count("\n")
    # one data row per run, every evaluation in it; the rows render the table the study wrote
    data_rows = read_rows(tmp_path / "rows.jsonl")
    assert sorted(r["run"] for r in data_rows) == ["mixit-L2-s0", "standard-L2-s0"]
    assert [e["step"] for e in data_rows[0]["evals"]] == [2, 4]
    assert "probe/icl_score" in data_rows[0]["evals"][-1]  # the probe's scalars, not its per-head lists
    assert not any(k.endswith("_heads") for e in data_rows[0]["evals"] for k in e)
    assert "--rows" not in data_rows[0]["command"] and "--smoke" in data_rows[0]["command"]
    rendered = induction.render_rows(data_rows)
    assert md.strip() in rendered and "| standard | 2 | 1 | " in rendered.split("against step")[1]


def test_induction_study_on_synthetic_copies_probes_random_tokens_only(tmp_path):
    out = tmp_path / "copy"
    args = ["--smoke", "--recipe", "recipes/induction_copy.yaml", "--out", str(out), "--variants", "standard,mixit"]
    assert induction.main([*args, "--seeds", "1", "data.task_args={length: 32, max_span: 16}"]) == 0
    assert not (out / "data").exists()  # no text, no tokenizer
    rows = [json.loads(x) for x in (out / "runs" / "standard-L2-s0" / "metrics.jsonl").read_text().splitlines()]
    probed = [r for r in rows if "probe/induction_score" in r]
    assert [r["step"] for r in probed] == [2, 4] and not any("probe/icl_score" in r for r in probed)
    assert len(probed[-1]["probe/prev_token_score_heads"]) == 2  # [layer][head]
    md = (out / "induction.md").read_text()
    assert "loss on the copy" in md and "| standard | 2 | 1 | 4 |" in md and "(fixed map)" in md
    assert (out / "induction.png").stat().st_size > 10_000


def test_packed_study_trains_every_layout_and_scores_offsets(tmp_path):
    out = tmp_path / "packed"
    assert packed.main(["--smoke", "--out", str(out), "--variants", "mixit", "--seeds", "1"]) == 0
    res = json.loads((out / "packed.json").read_text())
    assert set(res) == {"aligned/mixit", "packed/mixit", "docpack/mixit", "reset/mixit"}
    assert len(res["reset/mixit"][0]["by_offset"]) == 62
    assert list(res["aligned/mixit"][0]["by_offset"]) == ["0"]  # a 4-token context: offset 0 only
    assert len(res["packed/mixit"][0]["by_offset"]) == 62  # a and b fit: offsets 0..61 of 63
    cfg = (out / "runs" / "packed-mixit-s0" / "config.yaml").read_text()
    assert "seq_len: 63" in cfg
    assert (out / "packed.png").stat().st_size > 10_000
    assert "| docpack | mixit | 1 |" in (out / "packed.md").read_text()


@pytest.mark.parametrize("variant", ["standard", "mixit"])
def test_reset_layout_scores_each_example_as_if_alone(variant):
    """A `reset` model sees the scored example as its own document after any context, so its
    logits there are those of the example alone at position 0."""
    model = build_model(
        preset("tiny", variant=variant, vocab_size=256, max_seq_len=63, mixit_residual_scale=None), seed=0
    ).eval()
    stream = packed.context_stream("reset", [(1, 2), (3, 4)], packed.P, seed=0)
    pair = [packed.BASE + 5, packed.BASE + 6]
    with torch.no_grad():
        alone = model(torch.tensor([pair]))[:, -1]
        for start, o in ((0, 40), (1, 37), (2, 0), (3, 60)):
            x = torch.tensor([stream[start : start + o] + pair])
            ids = packed.document_ids(x)
            assert ids[0, -1] == ids[0, -2] != (ids[0, -3] if o else -1)
            torch.testing.assert_close(model(x, doc_ids=ids)[:, -1], alone, rtol=1e-5, atol=1e-5)


def test_packed_model_len_sets_the_context_and_refuses_one_shorter_than_a_window(tmp_path, capsys):
    out = tmp_path / "p"
    args = ["--smoke", "--out", str(out), "--variants", "mixit", "--seeds", "1", "--layouts"]
    assert packed.main(args + ["aligned,packed", "--model-len", "16"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --model-len 16 is shorter than a window (63). Fix: use >= 63"
    ]
    assert not (out / "runs").exists()
    assert packed.main(args + ["aligned", "--model-len", "63"]) == 0
    assert "max_seq_len: 63" in (out / "runs" / "aligned-mixit-s0-T63" / "config.yaml").read_text()


def test_packed_data_keeps_the_held_out_pairs_out_of_training(tmp_path):
    info = packed.write_data(tmp_path / "d.txt", 31, 1234, repeats=2, val_repeats=1)
    lines = (tmp_path / "d.txt").read_bytes().split(b"\n")[:-1]
    n_val = info["val_lines"]
    train, val = lines[:-n_val], lines[-n_val:]
    assert {packed.encode(a, b, (a + b) % 31) for a, b in info["test_pairs"]} == set(val)
    assert not set(train) & set(val) and len(train) == 2 * len(info["train_pairs"])
    assert all(len(x) == 3 for x in lines)
    assert int(len(lines) * info["val_fraction"]) == n_val  # the loader's tail is exactly them


def _copied_run(orig: list[str], out: list[str]) -> tuple[int, int, int]:
    """(start of the run in `orig`, its length, where `out` inserted it): `out` is `orig` with
    out[j:j+k] == orig[i:i+k] inserted at j."""
    n = len(out) - len(orig)
    for j in range(len(orig) + 1):
        if out[:j] == orig[:j] and out[j + n :] == orig[j:]:
            run = out[j : j + n]
            for i in range(j - n + 1):
                if orig[i : i + n] == run:
                    return i, n, j
    raise AssertionError("no inserted copy of an earlier run")


def test_span_repeats_copy_an_earlier_run_at_distances_that_vary():
    rng = random.Random(0)
    line = " ".join(f"w{i}" for i in range(150))
    found = [_copied_run(line.split(" "), induction.insert_repeat(line, 400, rng).split(" ")) for _ in range(30)]
    assert all(8 <= k <= 400 // 6 and j >= i + k for i, k, j in found)  # a run of 8+ words, after its end
    assert len({j - i for i, _, j in found}) > 10  # no fixed distance for a positional head to use


def test_random_words_follow_the_texts_frequencies():
    rng = random.Random(0)
    draw = induction.word_sampler(["a a a a a a a a a b", "a a a a a a a a a c"], rng)
    words = draw(5000)
    assert set(words) == {"a", "b", "c"}
    assert 0.87 < words.count("a") / len(words) < 0.93  # 18 of 20
