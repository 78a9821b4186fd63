"""The ladder end to end at a tiny budget: 2 sizes, 1 variant, stable runs and their cooldown branches
on the real trainer, collected and fitted (the joint fit, or its reason); the Slurm scripts."""

from __future__ import annotations

import csv
import json

import pytest
from fixtures import source_corpus

from common.errors import StudyError
from studies.scaling.cli import main
from studies.scaling.ladder import LADDER, branch_steps, non_embedding_params, plan_ladder
from studies.scaling.runs import collect_run

LADDER_ARGS = [
    "ladder",
    "--recipe",
    "recipes/tiny_cpu.yaml",
    "--variants",
    "standard",
    "--sizes",
    "n27k,n90k",
    "--budgets",
    "0.02,0.04,0.08",
    "--cooldown",
    "0.5",
]
OVERRIDES = ["optim.decay=constant", "optim.warmup_steps=1", "train.eval_every_steps=1000", "logging.tensorboard=false"]


def test_ladder_sizes_span_the_plan():
    counts = [non_embedding_params(s) for s in LADDER]
    assert counts == sorted(counts) and 25_000 < counts[0] < 30_000 and 1.9e6 < counts[-1] < 2.1e6
    assert counts[-1] / counts[0] > 30 and len(counts) >= 5
    # budgets become stable-run steps whose tokens with the cooldown are the budget's
    # (25.4, 50.9, 101.7, 203.5 exactly), rounded to multiples of the first: the stable run saves every 25 steps
    steps = branch_steps(100_000, [2.5, 5, 10, 20], 8192, 0.2, None)
    assert steps == [25, 50, 100, 200]
    assert branch_steps(100_000, [2.5, 5, 10, 20], 8192, 0.2, 1_000_000) == [25, 50, 100]
    assert branch_steps(100_000, [2.5, 5, 10, 20], 8192, 0.2, 100_000) == [10]  # all beyond the cap: the cap


def test_ladder_trains_stable_runs_and_branches_then_fits(tmp_path):
    """The whole pipeline at a tiny budget: a corpus of three sources to a tokenizer, shards and one
    validation set per source; the ladder (2 sizes, 1 variant, branches) with eval.tasks; rows; a fit."""
    _, _, sets = source_corpus(tmp_path)
    data = {"source": str(tmp_path / "train"), "val_fraction": 0, "val_sets": sets}
    out, log = tmp_path / "ladder", tmp_path / "rows.jsonl"
    args = [*LADDER_ARGS, "--jobs", "2", "--rows", str(log), "--out", str(out), *OVERRIDES]
    args += [f"data={json.dumps(data)}", "eval.tasks=[bits_per_byte]"]
    assert main(args) == 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    # n27k: 0.02..0.08 x 26784 tokens / 256 per step / 1.5 -> steps 1, 3, 6; n90k: 4.7, 9.4, 18.8 -> 5, 10, 20
    assert runs == sorted(
        ["standard-n27k-s0", "standard-n27k-s0-b1", "standard-n27k-s0-b3", "standard-n27k-s0-b6"]
        + ["standard-n90k-s0", "standard-n90k-s0-b5", "standard-n90k-s0-b10", "standard-n90k-s0-b20"]
    )
    assert {p.name for p in (out / "runs" / "standard-n90k-s0" / "checkpoints").glob("step_*")} == {
        "step_00000005",
        "step_00000010",
        "step_00000015",
        "step_00000020",
    }
    stable = out / "runs" / "standard-n27k-s0"
    assert {p.name for p in (stable / "checkpoints").iterdir()} >= {"step_00000001", "step_00000003", "step_00000006"}
    metrics = (out / "runs" / "standard-n27k-s0-b6" / "metrics.jsonl").read_text()
    branch = [json.loads(line) for line in metrics.splitlines()]
    assert [r["step"] for r in branch] == [7, 8, 9] and "val_loss" in branch[-1]  # resumed at 6, 3 decay steps
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(r["run"] for r in logged) == runs and all(r["cpu_seconds"] > 0 for r in logged)
    assert all(r["val_loss/prose"] > 0 and r["val_loss/code"] != r["val_loss/dict"] for r in logged)
    assert "eval/bpb/code" in branch[-1]
    assert main(args) == 0  # everything done: nothing retrains, nothing is logged twice
    assert len(log.read_text().splitlines()) == 8
    # the run directories are gone (another machine): the rows alone resume the study; a branch without
    # a row retrains with its stable run (for the checkpoint), and only the rows it lacked are added
    moved = tmp_path / "moved"
    (out / "runs").rename(moved)
    log.write_text("".join(json.dumps(r) + "\n" for r in logged if r["run"] != "standard-n27k-s0-b3"))
    assert main(args) == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["standard-n27k-s0", "standard-n27k-s0-b3"]
    relogged = [json.loads(line)["run"] for line in log.read_text().splitlines()]
    assert sorted(relogged) == runs
    rerun = collect_run(out / "runs" / "standard-n27k-s0-b3")
    before = next(r for r in logged if r["run"] == "standard-n27k-s0-b3")
    assert rerun["final_val_loss"] == before["final_val_loss"]  # the same run, trained again
    # rows written before a field existed get it from their run dirs; every recorded field stays
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    stripped = [{k: v for k, v in r.items() if k != "val_curve"} | {"cpu_seconds": 1.5} for r in rows]
    log.write_text("".join(json.dumps(r) + "\n" for r in stripped))
    assert main(["recollect", "--rows", str(log), "--runs", str(out / "runs")]) == 0
    after = {r["run"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert sorted(after) == runs and all(r["cpu_seconds"] == 1.5 for r in after.values())
    given = sorted(name for name, r in after.items() if "val_curve" in r)
    assert given == ["standard-n27k-s0", "standard-n27k-s0-b3"]  # the run dirs still here
    curve = after["standard-n27k-s0-b3"]["val_curve"]
    assert curve == rerun["val_curve"] and curve[-1] == [rerun["steps"], rerun["flops"], rerun["final_val_loss"]]
    (out / "runs").rename(tmp_path / "again")
    assert main(["collect", "--out", str(out), "--rows", str(log)]) == 0  # the rows alone make the table
    rows = list(csv.DictReader(open(out / "results.csv")))
    cooled = [r for r in rows if r["cooled"] == "True"]
    assert (
        len(rows) == 8 and len(cooled) == 6 and {r["branch_step"] for r in cooled} == {"1", "3", "6", "5", "10", "20"}
    )
    assert all(int(r["tokens"]) == int(r["steps"]) * 256 for r in rows)
    assert main(["fit", "--out", str(out), "--boot", "5"]) == 0
    fits = json.loads((out / "fits.json").read_text())
    # L(N) takes each size's smallest budget (2 points: too few, said so); L(C) every branch
    assert "at least 3 distinct sizes" in fits["non_embedding_params"]["standard"]["error"]
    assert fits["flops"]["standard"]["n_points"] == 6
    joint = fits["joint"]["standard"]
    assert joint["fit"]["n_points"] == 6 and set(joint["fit"]["intervals"]) == {"E", "A", "alpha", "B", "beta"}
    assert "needs >= 2 other sizes" in joint["held_out"]["error"]  # two sizes: no held-out check, said so


def test_ladder_slurm_scripts_and_bad_input(tmp_path):
    out = tmp_path / "slurm"
    args = [*LADDER_ARGS, "--variants", "standard,mixit", "--more-seeds", "n27k=2", "--out", str(out)]
    assert main([*args, "--batch-sequences", "n27k=4", "--slurm", *OVERRIDES]) == 0
    stable = (out / "stable.txt").read_text().splitlines()
    assert len(stable) == 6 and "--array=0-5" in (out / "ladder.sbatch").read_text()  # (2 + 1 seeds) x 2 variants
    submit = (out / "submit.sh").read_text()
    assert submit.count("--dependency=afterok:${STABLE}_") == 18  # 3 branches per stable run
    # n27k at 4 sequences (128 tokens) a step: branch steps 3, 6, 12 instead of 1, 3, 6
    assert "standard-n27k-s1/checkpoints/step_00000012" in submit
    small = [line for line in stable if "n27k" in line]
    assert len(small) == 4 and all("train.global_batch_sequences=4" in line for line in small)
    assert not any("global_batch_sequences" in line for line in stable if "n90k" in line)
    assert not list((out / "runs").iterdir())  # nothing trained
    assert main([*args, "--slurm"]) == 2  # the recipe's cosine decay: the stable runs need constant
    assert main([*LADDER_ARGS, "--sizes", "n3", "--out", str(out), *OVERRIDES]) == 2
    assert main(["recollect", "--rows", str(out / "none.jsonl"), "--runs", str(out / "runs")]) == 2
    with pytest.raises(StudyError, match="optim.decay=constant"):
        plan_ladder("recipes/tiny_cpu.yaml", ["standard"], ["n27k"], {"*": 1}, [1.0], 0.2, None, [])
