"""--run-dir: every checkpoint evaluated once (incremental), table + CSV + TensorBoard + PNG per metric; what
eval.run writes to a file it also shows (it printed only "wrote FILE")."""

import csv
import json

import torch

from eval.report import flatten, read_jsonl
from eval.run import main
from model import preset
from model.io import save_native
from model.transformer import build_model

torch.set_num_threads(1)


def make_run(root, variant, steps):
    run = root / f"run_{variant}"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(f"model:\n  variant: {variant}\n")
    for s in steps:
        m = build_model(preset("tiny", variant=variant, vocab_size=64, max_seq_len=32), seed=s)
        save_native(m, run / "checkpoints" / f"step_{s:08d}", {"step": s, "tokens_seen": 1000 * s, "variant": variant})
    return run


def test_run_dirs_incremental_reports(tmp_path, capsys):
    a = make_run(tmp_path, "standard", [10, 20])
    b = make_run(tmp_path, "mixit", [10, 20])
    out = tmp_path / "report"
    args = [
        "--run-dir",
        str(a),
        "--run-dir",
        str(b),
        "--tasks",
        "induction,kv_recall,mechanisms",
        "--lengths",
        "4,8",
        "--num-pairs",
        "2,4",
        "--n",
        "4",
        "--out-dir",
        str(out),
        "--no-progress",
    ]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert printed.out == (out / "results.md").read_text()  # the headline table, shown
    assert printed.err.startswith(f"wrote {out / 'results.md'}, {out / 'results.csv'}")
    rows = read_jsonl(a / "eval" / "results.jsonl")
    assert [r["checkpoint"]["step"] for r in rows] == [10, 20]
    assert rows[1]["checkpoint"]["tokens_seen"] == 20000 and rows[1]["checkpoint"]["variant"] == "standard"
    assert set(rows[0]["tasks"]["induction"]["by_length"]) == {"4", "8"}  # per-length scores kept
    assert set(rows[0]["tasks"]["kv_recall"]["by_num_pairs"]) == {"2", "4"}
    md = (out / "results.md").read_text()
    assert "induction/acc" in md and "mixit" in md and "standard" in md
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and {t["variant"] for t in table} == {"standard", "mixit"}
    assert "induction/by_length/8/acc" in table[0]
    assert (out / "plots" / "induction_acc.png").stat().st_size > 1000
    assert list((out / "tb" / "run_standard").glob("events.out.tfevents.*"))

    # a new checkpoint appears: only it is evaluated
    m = build_model(preset("tiny", variant="standard", vocab_size=64, max_seq_len=32), seed=30)
    save_native(m, a / "checkpoints" / "step_00000030", {"step": 30, "variant": "standard"})
    assert main(args) == 0
    rows = read_jsonl(a / "eval" / "results.jsonl")
    assert [r["checkpoint"]["step"] for r in rows] == [10, 20, 30]
    assert len(read_jsonl(b / "eval" / "results.jsonl")) == 2


def test_tensorboard_scalars_against_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a = make_run(tmp_path, "frozen_qk", [5, 15])
    assert main(["--run-dir", str(a), "--tasks", "induction", "--lengths", "4", "--n", "2", "--no-progress"]) == 0
    ea = EventAccumulator(str(a / "eval" / "tb" / "run_frozen_qk"))
    ea.Reload()
    ev = ea.Scalars("eval/induction/acc")
    assert [e.step for e in ev] == [5, 15]


def test_flatten():
    f = flatten({"t": {"acc": 0.5, "by_length": {"4": {"acc": 1}}, "grid": [[1]], "name": "x"}})
    assert f == {"t/acc": 0.5, "t/by_length/4/acc": 1.0}
    json.dumps(f)


def test_a_checkpoint_evaluated_into_a_file_shows_its_headline_numbers(tmp_path, capsys):
    ck = make_run(tmp_path, "standard", [7]) / "checkpoints" / "step_00000007"
    out = tmp_path / "results.json"
    args = ["--checkpoint", str(ck), "--tasks", "induction,kv_recall", "--lengths", "4", "--num-pairs", "2"]
    assert main([*args, "--n", "2", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr()
    metrics = json.loads(out.read_text())["metrics"]
    lines = printed.out.splitlines()
    assert lines[0].endswith("(step 7, standard)") and lines[1] == "| metric | value |"
    assert (
        f"| induction/acc | {metrics['induction/acc']:.4g} |" in lines
        and f"| kv_recall/loss | {metrics['kv_recall/loss']:.4g} |" in lines
    )
    assert not [x for x in lines if "/by_" in x]  # the per-length details stay in the file
    assert printed.err == f"wrote {out}\n"
