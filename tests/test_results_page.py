"""The results pages agree with their data rows: every table is re-rendered from docs/data and
compared with the page, and a changed row (or a hand-edited number) makes that check fail."""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import StudyError
from studies.results_page import (
    GPU_SPEED_RUN,
    GPU_SPEED_TABLES,
    bench_tokens_per_s,
    mean_std,
    ours_speed,
    read_capacity,
)

REPO = Path(__file__).resolve().parent.parent


def check(root: Path, *extra: str) -> subprocess.CompletedProcess:
    """The real command line, run on `root`'s docs."""
    return subprocess.run(
        [sys.executable, "-m", "studies.results_page", "render", "--root", str(root), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_repo_docs(tmp_path: Path) -> Path:
    """docs/ and the recipe its rows name, in a scratch root."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "docs", root / "docs")
    (root / "recipes").mkdir()
    shutil.copy(REPO / "recipes" / "capacity_memorization.yaml", root / "recipes")
    return root


def test_the_pages_agree_with_their_rows():
    done = check(REPO, "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    pages = [REPO / "docs" / "RESULTS.md", *sorted((REPO / "docs" / "results").glob("*.md"))]
    text = "".join(p.read_text() for p in pages)
    for name in ("summary", "rows-lost", "capacity-headline", "capacity-lengths", "capacity-mixit-draws"):
        assert f"<!-- table:{name} -->\n|" in text, name


def test_a_changed_row_fails_the_check_until_the_page_is_rendered(tmp_path):
    root = copy_repo_docs(tmp_path)
    rows_path = root / "docs" / "data" / "capacity_w8_625k" / "capacity.json"
    rows = json.loads(rows_path.read_text())
    mixit = [r for r in rows if r["variant"] == "mixit"]
    mixit[2]["bits_per_trainable_param"] += 0.25
    rows_path.write_text(json.dumps(rows))

    done = check(root, "--check")
    assert done.returncode == 1
    assert "docs/results/capacity.md: capacity-headline" in done.stdout
    assert "docs/RESULTS.md: summary" in done.stdout
    assert done.stderr.startswith("error: ") and "Fix: python -m studies.results_page render" in done.stderr

    assert check(root).returncode == 0
    assert check(root, "--check").returncode == 0
    new_mean, _ = mean_std([r["bits_per_trainable_param"] for r in mixit])
    assert f"{new_mean:.3f}" in (root / "docs" / "results" / "capacity.md").read_text()


def test_a_hand_edited_number_or_a_loose_table_fails_the_check(tmp_path):
    root = copy_repo_docs(tmp_path)
    page = root / "docs" / "results" / "capacity.md"
    text = page.read_text()
    head = text.index("<!-- table:capacity-headline -->")
    cells = read_capacity(root / "docs" / "data", root)
    standard = [c.bits_per_trainable_param for c in cells if c.variant == "standard" and c.steps == 625000]
    shown = f"{mean_std(standard)[0]:.3f}"
    at = text.index(shown, head)
    page.write_text(text[:at] + "9.999" + text[at + len(shown) :])
    done = check(root, "--check")
    assert done.returncode == 1 and "capacity-headline" in done.stdout

    page.write_text(text + "\n| a typed | table |\n|---|---|\n| 1.0 | 2.0 |\n")
    done = check(root, "--check")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "outside <!-- table:NAME --> markers" in done.stderr


def test_a_broken_row_file_is_one_error_line(tmp_path):
    root = copy_repo_docs(tmp_path)
    (root / "docs" / "data" / "capacity_w8_250k" / "capacity.json").write_text("[{not json")
    done = check(root, "--check")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_mean_and_std_match_the_statistics_module_on_random_values():
    rng = random.Random()
    for n in (1, 2, 3, 5, 11):
        values = [rng.uniform(-3, 3) for _ in range(n)]
        m, s = mean_std(values)
        assert abs(m - statistics.fmean(values)) < 1e-12
        assert abs(s - (statistics.stdev(values) if n > 1 else 0.0)) < 1e-12


def test_markdown_table_aligns_each_column_and_refuses_a_wrong_spec():
    from eval.report import markdown_table

    assert markdown_table(["a", "b", "c"], [[1, "x", 2.5]], align="rlr").splitlines() == [
        "| a | b | c |",
        "| ---: | --- | ---: |",
        "| 1 | x | 2.5 |",
    ]
    assert markdown_table(["a", "b"], [], right_from=1).splitlines()[1] == "| --- | ---: |"
    with pytest.raises(ValueError, match="one of l, r per column"):
        markdown_table(["a", "b"], [], align="r")


def test_the_speed_claim_is_each_variants_tokens_per_second_over_standards(tmp_path):
    """ours_speed reads the benchmark's own table lines (model, tok/s, ...) and divides by standard's."""
    rng = random.Random(7)
    expected = []
    for log, label in GPU_SPEED_TABLES:
        std, fq, mx = (rng.randint(10_000, 90_000) for _ in range(3))
        path = tmp_path / GPU_SPEED_RUN / log
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "model                    tok/s  TFLOP/s    MFU\n"
            f"standard {std} 374.0 46.7%\nfrozen_qk {fq} 365.8 45.7%\nmixit {mx} 343.4 42.9%\n"
            f"hf_llama 99999 394.2 49.2%\nprofile of one step: standard, 1b@2048\n"
        )
        assert bench_tokens_per_s(path) == {"standard": std, "frozen_qk": fq, "mixit": mx}
        expected.append(f"{label}: frozen-QK {100 * (fq / std - 1):+.1f} %, MixiT {100 * (mx / std - 1):+.1f} %")
    assert ours_speed(tmp_path).endswith("; ".join(expected))
    (tmp_path / GPU_SPEED_RUN / GPU_SPEED_TABLES[0][0]).unlink()
    with pytest.raises(StudyError, match="benchmark log is missing"):
        ours_speed(tmp_path)
