"""Capacity against training length: several studies' results read, grouped and compared to standard."""

from __future__ import annotations

import json
import math

from studies.capacity_trend import by_length, gain_per_doubling, main, read_rows


def _study(path, steps, values, width=8, cells=False):
    """A study as studies.capacity leaves it: its capacity.json (one row per (variant, seed) cell), or,
    with `cells`, only each finished cell's study_result.json (a study still under way)."""
    path.mkdir()
    rows = [
        {
            "variant": v,
            "width": width,
            "steps": steps,
            "seed_index": i,
            "bits_per_trainable_param": x,
            "final_loss": 2 - x,
        }
        for v, xs in values.items()
        for i, x in enumerate(xs)
    ]
    if not cells:
        (path / "capacity.json").write_text(json.dumps(rows))
    for r in rows if cells else []:
        (path / f"{r['variant']}_{r['seed_index']}").mkdir()
        (path / f"{r['variant']}_{r['seed_index']}" / "study_result.json").write_text(json.dumps(r))
    return path


def test_trend_groups_by_length_and_compares_to_standard(tmp_path, capsys):
    a = _study(tmp_path / "a", 1000, {"standard": [1.0, 1.2], "mixit": [0.5, 0.7]})
    b = _study(tmp_path / "b", 4000, {"standard": [1.5, 1.7], "mixit": [0.8]}, cells=True)
    trend = by_length(read_rows([a, b], 8))
    assert list(trend["standard"]) == [1000, 4000]
    assert math.isclose(trend["standard"][1000].mean, 1.1) and math.isclose(trend["mixit"][4000].mean, 0.8)
    # 1.1 -> 1.6 over two doublings of the steps
    assert math.isclose(gain_per_doubling(trend["standard"]), 0.25)
    assert gain_per_doubling({1000: trend["mixit"][1000]}) is None

    out = tmp_path / "fig" / "trend.png"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| standard | 1.100 ± 0.141 (2) | 1.600 ± 0.141 (2) | +0.250 | 2.98 |" in printed
    assert "| mixit | 0.55 | 0.50 | 0.73 |" in printed  # 0.6 / 1.1 and 0.8 / 1.6; the paper's 2.18 / 2.98
    assert "| standard | 0.900 ± 0.141 | 0.400 ± 0.141 |" in printed  # final losses 2 - bits
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trend_refuses_what_is_not_a_study(tmp_path, capsys):
    a = _study(tmp_path / "a", 1000, {"standard": [1.0]})
    assert main([str(a), str(tmp_path / "missing")]) == 2
    assert main([str(a), "--width", "16"]) == 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "capacity.json").write_text("{")
    assert main([str(tmp_path / "bad")]) == 2
    cell = _study(tmp_path / "cells", 1000, {"standard": [1.0]}, cells=True) / "standard_0" / "study_result.json"
    cell.write_text("[1.0]")  # valid JSON, not a cell's result
    assert main([str(tmp_path / "cells")]) == 2
    errs = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errs) == 4 and all(e.startswith("error: ") and "Fix:" in e for e in errs)
    assert (
        "does not exist" in errs[0] and "no finished cell of width 16" in errs[1] and "not a capacity study" in errs[2]
    )
    assert str(cell) in errs[3] and "not a cell's result" in errs[3]
