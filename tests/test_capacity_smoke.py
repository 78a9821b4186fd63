"""The memorization-capacity sweep runs at its smallest size (all four of the paper's variants)."""
from __future__ import annotations

import json
import math

from data_pipeline.synthetic import memorization_capacity_bits
from studies.capacity import PAPER_BITS_PER_PARAM, SMOKE, main, table


def test_capacity_smoke_sweep_writes_the_table(tmp_path):
    assert main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "capacity.json").read_text())
    assert [r["variant"] for r in rows] == ["standard", "frozen_qk", "mixit", "frozen_mlp"]
    for r in rows:
        assert r["width"] == SMOKE["widths"][0] and r["layers"] == 2 and r["n_pairs"] == 64
        assert r["bits"] == memorization_capacity_bits(64, 4, r["acc"])
        assert math.isclose(r["bits_per_trainable_param"], r["bits"] / r["params_trainable"])
        assert r["params_trainable"] <= r["params_total"]
    by = {r["variant"]: r for r in rows}
    assert by["frozen_mlp"]["params_trainable"] < by["frozen_qk"]["params_trainable"] < by["standard"]["params_trainable"]
    md = (tmp_path / "capacity.md").read_text()
    for v, bits in PAPER_BITS_PER_PARAM.items():
        assert f"| {v} |" in md and str(bits) in md


def test_table_shows_the_best_width_per_variant():
    rows = [{"variant": "standard", "width": w, "params_trainable": 10, "params_total": 10, "data_bits": 100.0,
             "acc": 0.5, "bits": b, "bits_per_trainable_param": b / 10, "bits_per_param": b / 10}
            for w, b in ((8, 10.0), (16, 25.0))]
    assert "| 2.500 | 2.98 |" in table(rows)
