"""The README's main command at a tiny step budget: trains, evaluates, tabulates, plots; with its
output sent to a log file (as on CI or Slurm), progress is a bounded number of compact lines."""

import json
import os
import re
import subprocess
import time

import pytest
import yaml
from conftest import REPO

from studies.demo import CONTEXT_GUESS, KV, MODADD, aggregate, main, table, verdict
from studies.retrieval import mode_guess_exact
from studies.scaling.runs import DONE
from studies.spread import Spread


def test_demo_end_to_end_small(tmp_path, capsys):
    out = tmp_path / "demo"
    log = tmp_path / "demo.log"
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(
            [
                str(REPO / "demo.sh"),  # the README's main command, as written (the README test leaves it to this one)
                "--out",
                str(out),
                "--variants",
                "standard,mixit",
                "--steps-scale",
                "0.01",
                "--eval-samples",
                "32",
            ],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # as a user runs it
            timeout=1200,
        )
    elapsed = time.time() - t0
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    assert "| modular addition (held-out pairs) |" in text
    assert re.search(r"Paper's qualitative result (HOLDS|does NOT hold)", text), text[-3000:]
    # progress: at most one line per 5% or per 30 s for each of the two stages, no tqdm bar redraws
    assert "\r" not in text and not re.search(r"\d+%\|.*\|", text)
    for stage in ("training", "evaluating"):
        lines = [line for line in text.splitlines() if line.startswith(f"{stage}: ")]
        assert lines, f"no {stage} progress line"
        assert len(lines) <= 20 + elapsed / 30 + 1, lines
    assert (out / "demo.png").stat().st_size > 10_000
    assert (out / "results.md").is_file() and (out / "results.json").is_file()
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == [
        "kv_retrieval-mixit",
        "kv_retrieval-standard",
        "modular_addition-mixit",
        "modular_addition-standard",
    ]
    assert all((out / "runs" / r / DONE).is_file() for r in runs)
    assert (
        main(["--out", str(out), "--variants", "standard,mixit", "--steps-scale", "0.01", "--eval-samples", "32"]) == 0
    )  # finished runs are skipped, not retrained
    assert "| modular addition (held-out pairs) |" in capsys.readouterr().out
    # a second seed: only the new runs train (seed 0 is the run dir above), with their own seed
    before = (out / "runs" / "modular_addition-mixit" / "metrics.jsonl").read_text()
    assert (
        main(
            ["--out", str(out), "--variants", "mixit", "--steps-scale", "0.01", "--eval-samples", "32", "--seeds", "2"]
        )
        == 0
    )
    assert (out / "runs" / "modular_addition-mixit" / "metrics.jsonl").read_text() == before
    cfg = yaml.safe_load((out / "runs" / "modular_addition-mixit-s1" / "config.yaml").read_text())
    assert cfg["seed"] == 1235 and cfg["model"]["mixit_seed"] == 1
    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == 2 and len(res["cells"]["modular_addition/mixit"]["values"]) == 2
    assert set(res["runs"]) == {
        "modular_addition/mixit",
        "modular_addition/mixit/s1",
        "kv_retrieval/mixit",
        "kv_retrieval/mixit/s1",
    }
    assert " ± " in (out / "results.md").read_text() and "2 seeds per cell" in (out / "results.md").read_text()


def test_verdict_reads_the_numbers():
    good = {
        ("modular_addition", "standard"): 1.0,
        ("modular_addition", "mixit"): 0.97,
        ("kv_retrieval", "standard"): 1.0,
        ("kv_retrieval", "mixit"): 0.5,
    }
    assert "HOLDS" in verdict(good, ["standard", "mixit"])
    bad = dict(good)
    bad[("modular_addition", "mixit")] = 0.3
    assert "does NOT hold" in verdict(bad, ["standard", "mixit"])
    bad = dict(good)
    bad[("kv_retrieval", "mixit")] = 0.95
    assert "does NOT hold" in verdict(bad, ["standard", "mixit"])
    assert "needs" in verdict(good, ["standard"])
    assert CONTEXT_GUESS == pytest.approx(mode_guess_exact(4, 8))  # 1-4 pairs of 8 values: 60.7 %
    assert "(in-context guess 60.7%" in table(good, (MODADD, KV), ["standard", "mixit"])
    md = table(good, (MODADD, KV), ["standard", "mixit"])
    assert "97.0%" in md and "11.2%" in md


def test_cells_over_seeds_are_mean_and_sample_std():
    per_seed = {
        ("modular_addition", "mixit", 0): 1.0,
        ("modular_addition", "mixit", 1): 0.5,
        ("modular_addition", "mixit", 2): 0.75,
        ("kv_retrieval", "mixit", 0): 0.25,
    }
    cells = aggregate(per_seed)
    c = cells[("modular_addition", "mixit")]
    assert (c.mean, c.lo, c.hi, c.values) == (0.75, 0.5, 1.0, (1.0, 0.5, 0.75))
    assert abs(c.std - 0.25) < 1e-12  # sample std of (1, .5, .75)
    assert cells[("kv_retrieval", "mixit")].std == 0.0  # one seed: no spread
    md = table(
        {
            **cells,
            ("modular_addition", "standard"): Spread.of([1.0, 1.0, 1.0]),
            ("kv_retrieval", "standard"): Spread.of([1.0]),
        },
        (MODADD, KV),
        ["standard", "mixit"],
    )
    assert "75.0 ± 25.0%" in md and "100.0 ± 0.0%" in md and "| 25.0% |" in md
    assert "HOLDS" not in verdict(
        cells | {("modular_addition", "standard"): Spread.of([1.0]), ("kv_retrieval", "standard"): Spread.of([1.0])},
        ["standard", "mixit"],
    )


def test_tasks_picks_rows_of_the_suite(tmp_path, capsys):
    out = tmp_path / "one"
    args = ["--suite", "paper", "--out", str(out), "--variants", "standard", "--steps-scale", "0.002"]
    assert main(args + ["--tasks", "khop_dense", "--eval-samples", "8"]) == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["khop_dense-standard"]
    assert "| 2-hop induction (answered at every position) |" in (out / "results.md").read_text()
    capsys.readouterr()
    assert main(args + ["--tasks", "khop_dense,bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tasks bogus: not in the paper suite. Fix:"), err
