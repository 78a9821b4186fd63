"""The learning-rate rule: the best rate per (variant, size) from a grid, an edge is an error, and the
line of log(best rate) against log N gives every ladder size its rate, which the ladder then uses."""

from __future__ import annotations

import json
import math
import random

import pytest

from common.errors import StudyError
from studies.scaling.cli import main
from studies.scaling.ladder import LADDER, ladder_rates, non_embedding_params, plan_ladder
from studies.scaling.lr import (
    choose_rates,
    extra_rates,
    lr_table,
    rate_check,
    rate_check_table,
    rate_overrides,
    rate_rule,
    transfer_check,
    transfer_sensitivity,
)

GRID = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]


def bowl(best_lr: float):
    """Losses of a grid with a minimum at best_lr (quadratic in log lr)."""
    return {lr: 3.0 + (math.log(lr) - math.log(best_lr)) ** 2 for lr in GRID}


def test_best_rate_per_variant_and_size_and_the_rule():
    # truth: lr* = N^-0.5 for standard, 1.5 N^-0.5 for mixit; losses are quadratic in log lr, so the
    # parabola through the lowest grid point and its neighbours finds lr* itself, between grid points
    losses = {}
    for variant, scale in (("standard", 1.0), ("mixit", 1.5)):
        for size in ("n27k", "n90k", "n214k"):
            target = scale * non_embedding_params(size, variant) ** -0.5
            for lr, loss in bowl(target).items():
                losses[(variant, size, lr)] = loss
    best = choose_rates(losses)
    for variant, scale in (("standard", 1.0), ("mixit", 1.5)):
        for size, lr in best[variant].items():
            target = scale * non_embedding_params(size, variant) ** -0.5
            assert lr == pytest.approx(target, rel=1e-6)
    rule = rate_rule(best)
    assert set(rule["standard"]["rates"]) == set(LADDER)
    assert rule["standard"]["slope"] == pytest.approx(-0.5, abs=1e-6)
    assert rule["mixit"]["rates"]["n2000k"] > rule["standard"]["rates"]["n2000k"]
    for size, lr in best["standard"].items():  # the line passes through the points it was fitted to
        assert rule["standard"]["rates"][size] == pytest.approx(lr, rel=1e-6)
    # a flat, noisy bottom: the lowest point sits beside the vertex, the best rate between them
    flat = {lr: 3.0 + 0.01 * (math.log(lr / 5e-3)) ** 2 for lr in GRID} | {8e-3: 3.0}
    chosen = choose_rates({("standard", "n27k", lr): loss for lr, loss in flat.items()})["standard"]["n27k"]
    assert 4e-3 < chosen < 8e-3


def test_best_rate_at_the_edge_of_the_grid_is_an_error():
    losses = {("standard", "n27k", lr): loss for lr, loss in bowl(5e-2).items()}
    with pytest.raises(StudyError, match="the edge of the grid"):
        choose_rates(losses)
    losses = {("standard", "n27k", lr): loss for lr, loss in bowl(5e-4).items()}
    with pytest.raises(StudyError, match="the edge of the grid"):
        choose_rates(losses)
    with pytest.raises(StudyError, match="needs a grid of >= 3"):
        choose_rates({("standard", "n27k", 1e-3): 3.0, ("standard", "n27k", 2e-3): 2.9})


def test_ladder_uses_the_rule_and_sweep_runs_decay(tmp_path):
    losses = {("standard", s, lr): loss for s in ("n27k", "n90k") for lr, loss in bowl(4e-3).items()}
    path = tmp_path / "lr.json"
    path.write_text(json.dumps(rate_rule(choose_rates(losses))))
    rates = ladder_rates(str(path))
    runs = plan_ladder(
        "recipes/tiny_cpu.yaml",
        ["standard"],
        ["n27k", "n600k"],
        {"*": 1},
        [0.05],
        0.5,
        None,
        ["optim.decay=constant", "optim.warmup_steps=1"],
        rates,
    )
    assert all(f"optim.lr={4e-3:.6g}" in r.overrides(0.5) for r in runs)
    stable = {r.size: r for r in runs if r.branch_step is None}  # --jobs starts the costliest chains first
    assert stable["n600k"].cost > stable["n27k"].cost > 0
    with pytest.raises(StudyError, match="no rates for"):
        plan_ladder(
            "recipes/tiny_cpu.yaml",
            ["mixit"],
            ["n27k"],
            {"*": 1},
            [0.05],
            0.5,
            None,
            ["optim.decay=constant", "optim.warmup_steps=1"],
            rates,
        )
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(StudyError, match="not an lr.json"):
        ladder_rates(str(bad))
    over = rate_overrides("mixit", "n27k", 2e-3, 5.0, batch=8)
    assert "optim.decay=wsd" in over and f"train.max_tokens={5 * non_embedding_params('n27k')}" in over
    assert "train.global_batch_sequences=8" in over


def test_lr_sweep_trains_the_grid_logs_rows_and_resumes_from_them(tmp_path):
    """A real grid at one size (a rate too small to move, a good one, one too large) and two seeds, two
    runs side by side; the rows alone (run directories gone) give the same lr.json without training again."""
    out, log = tmp_path / "lr", tmp_path / "rows.jsonl"
    args = [
        "lr-sweep",
        "--recipe",
        "recipes/tiny_cpu.yaml",
        "--variants",
        "standard",
        "--sizes",
        "n27k",
        "--seeds",
        "2",
    ]
    args += ["--lrs", "1e-5,3e-3,0.5", "--budget", "0.3", "--jobs", "2", "--rows", str(log), "--out", str(out)]
    args += ["optim.warmup_steps=1", "optim.min_lr=0", "train.eval_every_steps=1000", "logging.tensorboard=false"]
    args += ["model.rope_theta=500", "model.rope_theta=1000"]
    assert main(args) == 0
    rule = json.loads((out / "lr.json").read_text())
    assert 1e-5 < rule["standard"]["best"]["n27k"] < 0.5  # between the lowest loss's neighbours
    assert rule["standard"]["model_overrides"] == {"model.rope_theta": "1000"}  # the model it was measured on
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(r["lr"] for r in rows) == [1e-5, 1e-5, 3e-3, 3e-3, 0.5, 0.5] and {r["size"] for r in rows} == {"n27k"}
    by_seed = {r["seed_index"]: r for r in rows if r["lr"] == 3e-3}
    assert by_seed[0]["run"] == "standard-n27k-lr0.003" and by_seed[1]["run"] == "standard-n27k-lr0.003-s1"
    assert by_seed[0]["final_val_loss"] != by_seed[1]["final_val_loss"]  # another init and data order
    (out / "runs").rename(tmp_path / "gone")
    (out / "lr.json").unlink()
    assert main(args) == 0
    assert json.loads((out / "lr.json").read_text()) == rule and not list((out / "runs").iterdir())
    assert "| standard | n27k |" in (out / "lr.md").read_text()
    assert len(log.read_text().splitlines()) == 6


def test_transfer_check_compares_the_narrowest_and_widest_best_rates():
    """µP's transfer: within sqrt(2) holds, beyond it does not; the one rate is the geometric mean; a
    fixed-token grid point decays to a fraction of its own rate."""
    best = {"standard": {"w128": 1e-2, "w32": 8e-3}, "mixit": {"w32": 8e-3, "w64": 9e-3, "w128": 2e-2}}
    checks = transfer_check(best, "mup")
    assert (checks["standard"]["narrow"], checks["standard"]["wide"], checks["standard"]["width_ratio"]) == (
        "w32",
        "w128",
        4,
    )
    assert checks["standard"]["holds"] and checks["standard"]["rate"] == pytest.approx(math.sqrt(8e-5))
    assert not checks["mixit"]["holds"] and checks["mixit"]["rate_ratio"] == pytest.approx(2.5)
    assert transfer_check({"standard": {"w32": 1e-2}}, "mup") == {}  # one width: nothing to compare
    rule = rate_rule(best)
    for v, c in checks.items():
        rule[v]["transfer"] = c
    md = lr_table({(v, s, lr): 3.0 for v, r in best.items() for s, lr in r.items()}, rule)
    assert "| standard | mup | w32 → w128 (×4) |" in md and "2.50 (beyond √2)" in md
    over = rate_overrides("standard", "w128", 1e-2, 5.0, batch=8, tokens=2_048_000, min_lr_fraction=0.1)
    assert "train.max_tokens=2048000" in over and "optim.min_lr=0.001" in over and "model.hidden_size=128" in over
    assert not any(o.startswith("seed=") for o in over)  # seed 0: the recipe's
    assert {"seed=1236", "name=standard-w128-lr0.01-s2"} <= set(
        rate_overrides("standard", "w128", 1e-2, 5.0, seed=2, base_seed=1234)
    )


def test_transfer_interval_comes_from_the_seeds():
    """Seeds drawn around curves whose true best rates are 4x apart: the bootstrap interval of the ratio
    holds the point estimate, sits near the truth when the seeds agree, widens when they do not, and a
    one-seed sweep has none."""
    rng = random.Random(0)
    grid = [2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]
    truth = {"w32": 4e-3, "w128": 1.6e-2}

    def check(noise, n=4):
        per_seed = {
            ("standard", size, lr): [3.0 + 0.2 * math.log(lr / best) ** 2 + rng.gauss(0, noise) for _ in range(n)]
            for size, best in truth.items()
            for lr in grid
        }
        means = {k: sum(v) / len(v) for k, v in per_seed.items()}
        return transfer_check(choose_rates(means), "mup", per_seed, draws=300)["standard"], per_seed, means

    clean, _, _ = check(0.003)
    lo, hi = clean["ratio_interval"]
    assert clean["seeds"] == 4 and lo <= clean["rate_ratio"] <= hi
    assert 0.9 * 4 < lo and hi < 1.1 * 4  # agreeing seeds: tight, around the truth
    noisy, per_seed, means = check(0.05)
    assert math.log(noisy["ratio_interval"][1] / noisy["ratio_interval"][0]) > 3 * math.log(hi / lo)
    one = transfer_check(choose_rates(means), "mup", {k: v[:1] for k, v in per_seed.items()})["standard"]
    assert "ratio_interval" not in one and "seeds" not in one


def test_the_transfer_again_per_seed_and_per_window(tmp_path, capsys):
    """From an lr-sweep's rows: the rule's window (±1) gives the rule's ratio and its interval over the
    seeds; each seed's own ratio is its curves' alone; a wider window (±2) is a parabola through five
    rates. On curves that are parabolas in log(lr) every window finds the truth."""
    grid = [2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2]
    truth = {"w32": 5e-3, "w128": 1.2e-2}
    rows = [
        {"variant": "standard", "size": size, "lr": lr, "seed": 1234 + k,
         "final_val_loss": 3.0 + 0.1 * math.log(lr / best) ** 2 + 0.01 * k * (size == "w128")}
        for size, best in truth.items() for lr in grid for k in range(3)
    ]  # fmt: skip
    rows.append({**rows[0], "seed": 9})  # a seed with one point: not a curve, left out
    found = transfer_sensitivity(rows, draws=50)["standard"]
    assert found["seeds"] == [1234, 1235, 1236] and (found["narrow"], found["wide"]) == ("w32", "w128")
    for half, w in found["windows"].items():
        assert w["ratio"] == pytest.approx(2.4, rel=1e-6) and not w["holds"] and not w["edge"]
        assert [s["ratio"] for s in w["per_seed"]] == pytest.approx([2.4] * 3, rel=1e-6)
        assert w["ratio_interval"] == pytest.approx([2.4, 2.4], rel=1e-6)
    means = {k: sum(x) / len(x) for k, x in _per_seed(rows).items()}
    assert found["windows"][1]["ratio"] == pytest.approx(
        transfer_check(choose_rates(means), "mup")["standard"]["rate_ratio"]
    )
    (tmp_path / "lr_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["transfer", "--rows", str(tmp_path / "lr_rows.jsonl"), "--out", str(tmp_path / "t")]) == 0
    assert "| lr_rows | standard | w32 → w128 | 3 | ±2 |" in (tmp_path / "t" / "transfer.md").read_text()
    one_rate = [{**r, "lr": 1e-2} for r in rows]  # e.g. a grid's rows: one rate per width, no sweep
    assert transfer_sensitivity(one_rate) == {}
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["transfer", "--rows", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "t")]) != 0
    assert capsys.readouterr().err.startswith("error: --rows")


def _per_seed(rows):
    out = {}
    for r in rows:
        if r["seed"] != 9:
            out.setdefault((r["variant"], r["size"], r["lr"]), []).append(r["final_val_loss"])
    return out


def test_extra_rates_extend_one_variants_grid_only():
    assert extra_rates("mixit=5e-4:1e-3,frozen_qk=6.4e-2", ["standard", "mixit", "frozen_qk"]) == {
        "mixit": [5e-4, 1e-3],
        "frozen_qk": [6.4e-2],
    }
    for bad in ("shaped=1e-3", "mixit=", "mixit=fast", "mixit=-1e-3"):
        with pytest.raises(StudyError, match="--extra-lrs"):
            extra_rates(bad, ["standard", "mixit"])


def test_the_rate_check_moves_only_past_its_bar_and_refuses_an_incomplete_grid(tmp_path, capsys):
    """At x0.5, x1, x2 with seeds 0 and 1: a neighbour whose seed mean beats x1's by more than 2 sigma / sqrt(2)
    moves the rate, one within it does not; a repeated row counts once, and a missing seed or rate is one
    error."""

    def row(variant, lr, seed, loss, **kw):
        return {"variant": variant, "lr": lr, "seed": seed, "final_val_loss": loss, "cooled": True, "size": "w96",
                "budget": 8.8e13, **kw}  # fmt: skip

    sigma = 0.03  # bar 0.0424
    rows = [
        row("standard", lr, s, loss + 0.01 * s)
        for lr, loss in ((5e-3, 2.80), (1e-2, 2.79), (2e-2, 2.76))
        for s in (0, 1)
    ]
    rows += [row("frozen_qk", lr, s, loss) for lr, loss in ((4e-3, 3.10), (8e-3, 3.20), (1.6e-2, 3.25)) for s in (0, 1)]
    # 0.05 below x1: past 2 sigma / sqrt(2) = 0.042, short of 2 sigma; rates as rows hold them (6 figures)
    rows += [
        row("mixit", lr, s, loss)
        for lr, loss in ((0.0059596, 4.20), (0.0119192, 4.15), (0.0238385, 4.10))
        for s in (0, 1)
    ]
    rows += [row("standard", 1e-2, 0, 9.0), row("standard", 1e-2, 2, 9.0), row("standard", 1e-2, 0, 9.0, size="w64")]
    result = rate_check(rows, 8.8e13, "w96", {"standard": sigma, "frozen_qk": sigma, "mixit": sigma})
    assert result["mixit"]["moves"] and result["mixit"]["factor"] == 2.0
    assert not result["standard"]["moves"] and result["standard"]["mean"][1] == pytest.approx(2.795)  # 0.03 < bar
    assert result["frozen_qk"]["moves"] and result["frozen_qk"]["factor"] == 0.5
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    noise = tmp_path / "profiles.json"
    noise.write_text(json.dumps({"noise": {v: {"sigma": sigma} for v in ("standard", "frozen_qk", "mixit")}}))
    args = ["rate-check", "--rows", str(path), "--noise-from", str(noise), "--out", str(tmp_path / "out")]
    assert main(args) == 0 and "moves to x0.5" in capsys.readouterr().out
    assert main([*args[:2], str(tmp_path / "absent.jsonl"), *args[3:]]) == 2
    with pytest.raises(StudyError, match="seeds missing"):
        rate_check(
            [r for r in rows if not (r["lr"] == 2e-2 and r["seed"] == 1)],
            8.8e13,
            "w96",
            dict.fromkeys(result, sigma),
        )
    with pytest.raises(StudyError, match="not x0.5, x1, x2"):
        rate_check([r for r in rows if r["lr"] != 5e-3], 8.8e13, "w96", dict.fromkeys(result, sigma))


def test_the_rate_checks_second_seed_is_needed_only_within_2_sigma_of_x1():
    """The budget's stage B (docs/SCALING.md): a neighbour whose seed 0 lies 2 sigma or more above x1's mean
    does not move the rate on that seed alone; one within 2 sigma needs its seed 1; --variants leaves out a
    variant whose check waits for a GPU."""

    def row(variant, lr, seed, loss):
        return {"variant": variant, "lr": lr, "seed": seed, "final_val_loss": loss, "cooled": True, "size": "w96",
                "budget": 8.8e13}  # fmt: skip

    sigma = 0.014
    x1 = [row("frozen_qk", 8e-3, s, 3.20) for s in (0, 1)]
    far = [row("frozen_qk", 4e-3, 0, 3.20 + 2.1 * sigma)]
    near = [row("frozen_qk", 1.6e-2, 0, 3.20 + 1.9 * sigma)]
    mixit = [row("mixit", 1e-2, 0, 4.2)]  # x1 only: its check is not on the CPU
    noise = {"frozen_qk": sigma}
    with pytest.raises(StudyError, match=r"seeds missing at \{'0.016': \[1\]\}"):
        rate_check(x1 + far + near + mixit, 8.8e13, "w96", noise, variants=["frozen_qk"])
    rows = x1 + far + near + [row("frozen_qk", 1.6e-2, 1, 3.15)] + mixit
    result = rate_check(rows, 8.8e13, "w96", noise, variants=["frozen_qk"])["frozen_qk"]
    assert (
        result["seeds_per_rate"] == [[0], [0, 1], [0, 1]] and not result["moves"]
    )  # (3.2266 + 3.15) / 2 > 3.2 - 0.0198
    assert "(seed 0 only: 2 sigma above x1)" in rate_check_table({"frozen_qk": result})
    rows[-2] = row("frozen_qk", 1.6e-2, 1, 3.10)  # mean 3.163: below 3.20 - 0.0198, it moves
    assert rate_check(rows, 8.8e13, "w96", noise, variants=["frozen_qk"])["frozen_qk"]["factor"] == 2.0
    with pytest.raises(StudyError, match="rates"):
        rate_check(rows, 8.8e13, "w96", noise | {"mixit": sigma})  # every variant: MixiT has one rate
