"""A sweep end to end on the real trainer: runs, skips finished points, collects, fits."""

import csv
import json
import shlex

from pretrain.config import load_recipe
from studies.scaling.cli import main


def test_sweep_collect_fit(tmp_path):
    out = tmp_path / "sweep"
    args = [
        "sweep",
        "--recipe",
        "recipes/tiny_cpu.yaml",
        "--variants",
        "mixit",
        "--sizes",
        "tiny",
        "--seeds",
        "2",
        "--out",
        str(out),
        "train.max_steps=3",
        "train.eval_every_steps=3",
        "checkpoint.every_steps=0",
        "logging.tensorboard=false",
    ]
    assert main(args) == 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == ["mixit-tiny-s0", "mixit-tiny-s1"]
    done = (out / "runs" / "mixit-tiny-s0" / "sweep_done.json").stat().st_mtime
    assert main(args) == 0  # finished points are skipped
    assert (out / "runs" / "mixit-tiny-s0" / "sweep_done.json").stat().st_mtime == done
    assert main(["collect", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 2 and {r["variant"] for r in rows} == {"mixit"}
    from model import preset
    from model.flops import flops_per_token

    row = rows[0]
    assert int(row["steps"]) == 3 and float(row["final_val_loss"]) > 0
    cfg = preset("tiny", variant="mixit", vocab_size=35, max_seq_len=32)
    assert float(row["flops"]) == flops_per_token(cfg, 32)["train"] * int(row["tokens"])
    assert "± " in (out / "results.md").read_text()  # seeds give a spread
    assert main(["fit", "--out", str(out)]) == 0  # one size: the reason, not a crash
    fits = json.loads((out / "fits.json").read_text())
    assert "at least 3 distinct sizes" in fits["non_embedding_params"]["mixit"]["error"]
    assert (out / "loss_vs_params.png").is_file()


def test_slurm_array_script(tmp_path):
    out = tmp_path / "sweep"
    assert (
        main(
            [
                "sweep",
                "--recipe",
                "recipes/tiny_cpu.yaml",
                "--variants",
                "standard,frozen_qk,mixit",
                "--sizes",
                "tiny,xs",
                "--tokens",
                "100000",
                "--out",
                str(out),
                "--slurm",
            ]
        )
        == 0
    )
    script = (out / "sweep.sbatch").read_text()
    assert "--array=0-5" in script and "launch.sh --slurm" in script
    lines = (out / "points.txt").read_text().splitlines()
    assert len(lines) == 6 and all("train.max_tokens=100000" in l and "--resume auto" in l for l in lines)
    assert not (out / "runs" / "standard-tiny-s0" / "metrics.jsonl").exists()  # nothing trained


def test_study_runs_are_one_tracker_group_each_named_after_its_cell(tmp_path):
    out = tmp_path / "study"
    wandb = 'logging.wandb={"project": "variants", "mode": "offline"}'
    mlflow = 'logging.mlflow={"tracking_uri": "file:./mlruns", "group": "mine"}'
    args = ["sweep", "--recipe", "recipes/tiny_cpu.yaml", "--variants", "standard,mixit", "--sizes", "tiny"]
    assert main([*args, "--tokens", "1000", "--out", str(out), "--slurm", wandb, mlflow]) == 0
    lines = (out / "points.txt").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        argv = shlex.split(line)
        cfg = load_recipe(argv[argv.index("--recipe") + 1], argv[argv.index("auto") + 1 :])
        assert cfg.logging.wandb["group"] == "sweep:study"  # the study, where the recipe sets no group
        assert cfg.logging.mlflow["group"] == "mine"  # a recipe's own group is kept
        assert cfg.name in {"standard-tiny-s0", "mixit-tiny-s0"}  # the cell: each tracker's run name
