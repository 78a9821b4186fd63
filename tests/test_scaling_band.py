"""The band of analysis choices on rows drawn from a known law: every combination (window, standard's map,
approach 3, validation set) gives back the known compute multiplier; the published combination is the
profiles' own; a degenerate fit (no irreducible loss to find) is reported as not identified, not raised."""

from __future__ import annotations

import json

import numpy as np
import pytest

from studies.scaling.band import band, report_markdown
from studies.scaling.cli import main
from studies.scaling.profiles import analyse

# L(N, D) = E + A N^-a + B D^-b with C = 6 N D: N* = G (C/6)^(b/(a+b)) whatever E; a variant whose data
# is worth k times standard's reaches at C the loss standard reaches at k C, so its multiplier is k
A, ALPHA, B, BETA = 400.0, 0.34, 410.0, 0.28
BUDGETS = [1e15, 2e15, 4e15, 8e15]
STANDARD_ONLY = [2.5e14, 5e14]  # standard reaches down to the variants' losses, as the grid's does
K = 0.3
SETS = {"val_loss/linux-doc": 0.4, "val_loss/gcide": -0.3}  # each set's loss: the pooled one shifted


def n_star(C):
    G = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    return G * (C / 6) ** (BETA / (ALPHA + BETA))


def rows_from_law(variant, k, budgets, E, rng, sets=True):
    rows = []
    for C in budgets:
        for i in range(-2, 3):
            N = n_star(C) * 1.6**i
            D = C / (6 * N)
            loss = E + A * N**-ALPHA + B * (k * D) ** -BETA
            row = {"variant": variant, "budget": C, "size": f"x{i}", "seed": 0, "cooled": True, "steps": 1000,
                   "non_embedding_params": N, "tokens": D, "flops": C, "final_val_loss": loss + rng.normal(0, 0.002)}  # fmt: skip
            if sets:
                row.update({key: loss + shift + rng.normal(0, 0.002) for key, shift in SETS.items()})
            rows.append(row)
    return rows


def grid(E, sets=True):
    rng = np.random.default_rng(0)
    return rows_from_law("standard", 1.0, STANDARD_ONLY + BUDGETS, E, rng, sets) + rows_from_law(
        "frozen_qk", K, BUDGETS, E, rng, sets
    )


def test_every_combination_gives_back_the_known_multiplier():
    result = band(grid(E=1.5), n_boot=10, draws=3)
    combos = [c for c in result["combinations"] if c["variant"] == "frozen_qk"]
    assert len(combos) == 3 * (2 * 4 + 1)  # sets x (windows x maps + approach 3)
    for c in combos:
        assert c["status"] == "identified", c
        for b, e in c["per_budget"].items():
            assert e["multiplier"] == pytest.approx(K, rel=0.12), (c["set"], c["approach"], c["window"], c["map"], b)
            assert not e["extrapolated"]
        assert abs(c["trend"]["per_decade"]) < 0.06
    s = result["summary"]["frozen_qk"]
    assert s["slope_combinations"] == len(combos) and all(
        K / 1.12 < x < K * 1.12 for x in s["per_budget"][1e15]["band"]
    )
    # the published combination is the profiles' analysis itself
    published = analyse(grid(E=1.5), n_boot=10)["multipliers"]["frozen_qk"]
    assert s["per_budget"][1e15]["published"] == published["per_budget"][1e15]
    assert s["published_trend"] == published["trend"]
    md = report_markdown(result)
    assert "#### frozen_qk: the band" in md and "python-doc" in md


def test_a_floor_the_fits_cannot_reach_is_not_identified_and_the_rest_stands(tmp_path, capsys):
    """A loss that falls faster than a power law (a floor below 0, as standard's optima fall in the grid's
    rows) puts E at its bound 0 in the law with a floor and in approach 3: both are reported as not
    identified, out of the band; every other combination still finds the multiplier. Rows without the
    per-set losses give the pooled set alone; rows without standard are one error line."""
    rows = grid(E=-0.5, sets=False)
    log = tmp_path / "rows.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "band"
    assert main(["band", "--rows", str(log), "--out", str(out), "--boot", "10", "--draws", "2"]) == 0
    result = json.loads((out / "band.json").read_text())
    assert list(result["sets"]) == ["pooled"]
    status = {(c["approach"], c["map"]): c["status"] for c in result["combinations"] if c["window"] in (2, None)}
    assert status[("2", "law with a floor")].startswith("not identified: E at its bound 0")
    assert status[("3", None)].startswith("not identified: standard's fit: E at its bound 0")
    assert status[("2", "law")] == status[("2", "interpolation")] == "identified"
    low, high = result["summary"]["frozen_qk"]["per_budget"]["1e+15"]["band"]
    assert low == pytest.approx(K, rel=0.12) and high == pytest.approx(K, rel=0.12)
    assert "not identified: E at its bound 0" in (out / "band.md").read_text()
    only = tmp_path / "only.jsonl"
    only.write_text("".join(json.dumps(r) + "\n" for r in rows if r["variant"] == "standard"))
    assert main(["band", "--rows", str(only), "--out", str(tmp_path / "x")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Fix:" in err[0]
