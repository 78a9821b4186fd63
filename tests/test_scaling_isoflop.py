"""The IsoFLOP plan: every branch holds its budget in its variant's own FLOPs to within a step, one batch
and one µP rate per variant, min_lr a fraction of it; grids that break the step or epoch rule, budgets
that are not whole multiples, a failed transfer check and unprepared data are refused before training;
a tiny grid trains end to end and its rows carry their budgets and device; a grid split across machines
trains each share's chains and merges back whole chains only."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from fixtures import source_corpus

from common.errors import StudyError
from studies.rows import append_row, read_rows
from studies.scaling.cli import main
from studies.scaling.isoflop import more_seeds, only_chains, parse_grid, plan_isoflop, transfer_rates
from studies.scaling.ladder import LadderRun, refuse_other_rates
from studies.scaling.runs import RUN_NAME, chain_name, merge_share, run_name

MUP = [
    "model.parametrization=mup",
    "model.mup_base_width=32",
    "model.mup_base_head_dim=16",
    "model.mixit_width_base=null",
]
BASE = [*MUP, "optim.decay=constant", "optim.warmup_steps=1", "train.seq_len=32", "logging.tensorboard=false"]


def lr_json(path, holds=True, variants=("standard", "mixit"), model=tuple(MUP), rate=4e-3):
    rule = {
        v: {"slope": 0.0, "intercept": 0.0, "best": {}, "rates": {},
            "transfer": {"holds": holds, "rate": rate, "rate_ratio": 1.0 if holds else 2.5, "narrow": "w32", "wide": "w128"},
            "model_overrides": dict(o.split("=", 1) for o in model)}
        for v in variants
    }  # fmt: skip
    path.write_text(json.dumps(rule))
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    _, _, sets = source_corpus(root)
    data = {"source": str(root / "train"), "val_fraction": 0, "val_sets": sets}
    return root, [*BASE, f"data={json.dumps(data)}", "train.global_batch_sequences=4", "train.micro_batch_sequences=4"]


def test_each_branch_holds_its_budget_in_its_own_flops(corpus, tmp_path):
    _, over = corpus
    grid = parse_grid("2e10=w32:w48,4e10=w32:w64,8e10=w48:w64")
    assert grid == {2e10: ["w32", "w48"], 4e10: ["w32", "w48", "w64"], 8e10: ["w48", "w64"]}
    rates = transfer_rates(lr_json(tmp_path / "lr.json"))
    runs = plan_isoflop("recipes/tiny_cpu.yaml", ["standard", "mixit"], grid, {"*": 1}, 0.2, rates, 0.1, over, 10, 50)
    branches = [r for r in runs if r.branch_step is not None]
    assert len(branches) == 2 * (2 + 3 + 2)
    base = {r.stable_name: r.checkpoint_every for r in runs if r.branch_step is None}
    for r in branches:
        # S_1 rounds to a whole step, so budget k = m S_1 is off by m/2 steps at most, the cooldown by 1/2
        tokens = r.max_steps * r.tokens_per_step  # the stable prefix and the cooldown
        slack = (r.branch_step / base[r.stable_name] / 2 + 0.5) * r.tokens_per_step * r.flops_per_token
        assert abs(tokens * r.flops_per_token - r.budget) <= slack
        assert r.tokens_per_step == 4 * 32 and r.lr == 4e-3 and r.min_lr == pytest.approx(4e-4)
    for r in [r for r in runs if r.branch_step is None]:  # the stable run saves at every branch point
        own = [b.branch_step for b in branches if b.stable_name == r.stable_name]
        assert r.max_steps == max(own) and all(s % r.checkpoint_every == 0 for s in own)
    # MixiT has no Q/K: fewer FLOPs per token, so more tokens at the same budget and size
    by = {(r.variant, r.size, r.budget): r for r in branches}
    assert by[("mixit", "w48", 4e10)].max_steps > by[("standard", "w48", 4e10)].max_steps
    assert by[("standard", "w32", 4e10)].branch_step == 2 * by[("standard", "w32", 2e10)].branch_step
    # budgets standard alone trains extend its chains below the grid; the other variants' stay as they were
    low = {1e10: ["w32", "w48"]}
    more = plan_isoflop(
        "recipes/tiny_cpu.yaml", ["standard", "mixit"], grid, {"*": 1}, 0.2, rates, 0.1, over, 10, 50, low
    )
    extra = {(r.variant, r.size, r.budget) for r in more if r.branch_step is not None} - set(by)
    assert extra == {("standard", "w32", 1e10), ("standard", "w48", 1e10)}


def test_a_grid_that_breaks_a_rule_is_refused_before_training(corpus, tmp_path):
    root, over = corpus
    rates = transfer_rates(lr_json(tmp_path / "lr.json"))

    def plan(grid, min_steps=10, max_epochs=50, o=over):
        return plan_isoflop(
            "recipes/tiny_cpu.yaml", ["standard"], parse_grid(grid), {"*": 1}, 0.2, rates, 0.1, o, min_steps, max_epochs
        )

    with pytest.raises(StudyError, match="fewer than --min-steps 500"):
        plan("2e10=w32:w64", min_steps=500)
    with pytest.raises(StudyError, match="passes over the"):
        plan("2e10=w32:w64", max_epochs=0.01)
    with pytest.raises(StudyError, match="not whole multiples"):
        plan("2e10=w32:w48,3e10=w32:w48")
    with pytest.raises(StudyError, match="must be FLOPS=FIRST:LAST"):
        parse_grid("2e10=w33:w48")
    with pytest.raises(StudyError, match="wider than"):
        parse_grid("2e10=w64:w32")
    with pytest.raises(StudyError, match="beyond sqrt"):
        transfer_rates(lr_json(tmp_path / "bad.json", holds=False))
    mixed = json.loads(open(lr_json(tmp_path / "mixed.json")).read())
    mixed["mixit"]["transfer"]["holds"] = False
    (tmp_path / "mixed.json").write_text(json.dumps(mixed))
    assert transfer_rates(str(tmp_path / "mixed.json"), ["standard"])["standard"].rate == 4e-3  # only those asked for
    with pytest.raises(StudyError, match="mixit's best rate moves"):
        transfer_rates(str(tmp_path / "mixed.json"), ["standard", "mixit"])
    with pytest.raises(StudyError, match="no rate for"):
        plan_isoflop("recipes/tiny_cpu.yaml", ["frozen_qk"], parse_grid("2e10=w32"), {}, 0.2, rates, 0.1, over)
    missing = [*BASE, f"data.source={root / 'absent'}"]
    with pytest.raises(StudyError, match="prepare the data first"):
        plan("2e10=w32:w48", o=missing)


def test_a_rate_serves_only_the_model_it_was_measured_on(corpus, tmp_path, capsys):
    """lr.json records the sweep's `model.*` overrides: a grid whose model differs for a variant (here
    MixiT's plain residual, its own override) refuses that rate, naming the key; a variant's own lr.json
    (`PATH,mixit=PATH`) measured on that model serves it, and its runs carry the override."""
    _, over = corpus
    plain = ["model.mixit_residual_scale=null"]
    grid, scaled = parse_grid("2e10=w32:w48"), lr_json(tmp_path / "lr.json", variants=("standard", "mixit"))

    def plan(spec, own):
        rates = transfer_rates(spec, ["standard", "mixit"])
        return plan_isoflop(
            "recipes/tiny_cpu.yaml", ["standard", "mixit"], grid, {}, 0.2, rates, 0.1, over, 10, 50, None, own
        )

    with pytest.raises(
        StudyError, match=r"measured on another model \(model.mixit_residual_scale: \(recipe\) there, null here"
    ):
        plan(scaled, {"mixit": plain})
    failed = lr_json(tmp_path / "failed.json", holds=False, variants=("mixit",))  # the scaled residual's check failed
    own = lr_json(tmp_path / "plain.json", variants=("mixit",), model=(*MUP, *plain), rate=2e-3)
    with pytest.raises(StudyError, match="mixit's best rate moves"):
        transfer_rates(f"{failed}", ["mixit"])
    runs = plan(f"{scaled},mixit={own}", {"mixit": plain})
    for r in runs:
        assert (r.lr, r.extra) == ((2e-3, tuple(plain)) if r.variant == "mixit" else (4e-3, ()))
        assert (plain[0] in r.overrides(0.2)) == (r.variant == "mixit")
    legacy = json.loads(open(scaled).read())
    del legacy["standard"]["model_overrides"]
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    with pytest.raises(StudyError, match="does not record the model"):
        plan(str(tmp_path / "legacy.json"), {})
    bad = ["isoflop", "--recipe", "recipes/tiny_cpu.yaml", "--grid", "2e10=w32", "--lr-from", own, "--out",
           str(tmp_path / "o"), "--variant-override", "mixit", *over]  # fmt: skip
    assert main(bad) != 0 and not (tmp_path / "o").exists()
    assert capsys.readouterr().err.startswith("error: --variant-override 'mixit' must be VARIANT:KEY=VALUE")


def test_a_failed_check_trains_only_with_a_rate_per_width_through_its_two_optima(corpus, tmp_path):
    """--per-width-rates VARIANT: the rate is log-linear in log width through the check's optima at w32 and
    w128 (w64, half-way in log width: their geometric mean) and held at them outside (w16, w192); refused
    for a variant whose check held or that no lr.json checked."""
    _, over = corpus
    failed = json.loads(open(lr_json(tmp_path / "failed.json", holds=False, variants=("frozen_qk",))).read())
    failed["frozen_qk"]["best"] = {"w32": 3.2e-2, "w128": 8e-3}
    (tmp_path / "failed.json").write_text(json.dumps(failed))
    rate = transfer_rates(str(tmp_path / "failed.json"), ["frozen_qk"], ["frozen_qk"])["frozen_qk"]
    assert [rate.at(s) for s in ("w16", "w32", "w64", "w128", "w192")] == pytest.approx(
        [3.2e-2, 3.2e-2, 1.6e-2, 8e-3, 8e-3]
    )
    runs = plan_isoflop(
        "recipes/tiny_cpu.yaml", ["frozen_qk"], parse_grid("2e10=w32:w64"), {}, 0.2, {"frozen_qk": rate}, 0.1, over, 10
    )
    assert {r.size: r.lr for r in runs} == pytest.approx(
        {"w32": 3.2e-2, "w48": 3.2e-2 * 0.25 ** (math.log(1.5) / math.log(4)), "w64": 1.6e-2}
    )
    assert all(r.min_lr == pytest.approx(0.1 * r.lr) for r in runs)
    with pytest.raises(StudyError, match="within sqrt\\(2\\), so one rate serves every width. Fix: drop standard"):
        transfer_rates(lr_json(tmp_path / "held.json"), ["standard"], ["standard"])
    with pytest.raises(StudyError, match="--per-width-rates mixit: no transfer check of it"):
        transfer_rates(str(tmp_path / "failed.json"), ["frozen_qk"], ["frozen_qk", "mixit"])


def test_the_rate_check_trains_every_run_at_a_multiple_of_its_rate(corpus, tmp_path, monkeypatch):
    """--lr-factor 0.5: every run's rate (one rate, or a rate per width through the optima) and its min_lr
    halve, nothing else changes; a factor that is not positive is one error before any work."""
    _, over = corpus
    planned = {}
    monkeypatch.setattr("studies.scaling.isoflop.train_plan", lambda args, runs, what: planned.update(runs=runs) or 0)
    args = ["isoflop", "--recipe", "recipes/tiny_cpu.yaml", "--variants", "standard", "--grid", "1e10=w32:w48"]
    args += ["--lr-from", lr_json(tmp_path / "lr.json"), "--min-steps", "3", "--max-epochs", "50"]
    args += ["--out", str(tmp_path / "out"), "--rows", str(tmp_path / "rows.jsonl"), *over]
    assert main([*args, "--lr-factor", "0.5"]) == 0
    halved = planned["runs"]
    assert [x for r in halved for x in (r.lr, r.min_lr)] == pytest.approx([2e-3, 2e-4] * 4)
    assert main(args) == 0 and {r.lr for r in planned["runs"]} == {4e-3}
    assert [dataclasses.replace(r, lr=None, min_lr=None) for r in halved] == [
        dataclasses.replace(r, lr=None, min_lr=None) for r in planned["runs"]
    ]
    rate = transfer_rates(lr_json(tmp_path / "lr.json"), ["standard"])["standard"]
    per_width = type(rate)(1e-2, None, "x", {"w32": 3.2e-2, "w128": 8e-3})
    assert per_width.scaled(2).at("w64") == pytest.approx(2 * per_width.at("w64"))
    assert main([*args, "--lr-factor", "0"]) == 2 and main([*args, "--lr-factor", "inf"]) == 2


def test_a_plan_refuses_rows_that_hold_its_runs_at_another_rate(tmp_path):
    """Run names do not carry the rate: the rate check's runs pointed at the grid's rows would be skipped as
    done; one line instead, before anything trains."""
    runs = [LadderRun("standard", "w96", 0, 100, 80, lr=2e-3, budget=1e10)]
    refuse_other_rates(runs, [{"run": runs[0].name, "lr": 2e-3}], "rows.jsonl")  # the same rate (6 figures): fine
    with pytest.raises(StudyError, match="holds standard-w96-s0-b80 at lr 0.004; this plan trains it at 0.002"):
        refuse_other_rates(runs, [{"run": runs[0].name, "lr": 4e-3}], "rows.jsonl")


def test_extra_seeds_stop_at_the_budget_they_are_needed_for(corpus, tmp_path):
    """--more-seeds w32=3@2e10: seeds 1 and 2 of w32 train its chain only to the 2e10 branch (their stable
    run ends at its step); seed 0 keeps every budget, and w48 keeps one seed."""
    _, over = corpus
    rates = transfer_rates(lr_json(tmp_path / "lr.json"))
    counts, caps = more_seeds("w32=3@2e10")
    grid = parse_grid("1e10=w32:w48,2e10=w32:w48,4e10=w32")
    runs = plan_isoflop(
        "recipes/tiny_cpu.yaml", ["standard"], grid, {"*": 1, **counts}, 0.2, rates, 0.1, over, 10, 50, None, None, caps
    )
    chains = {}
    for r in runs:
        chains.setdefault((r.size, r.seed), []).append(r.budget)
    assert chains == {
        ("w32", 0): [None, 1e10, 2e10, 4e10],
        ("w32", 1): [None, 1e10, 2e10],
        ("w32", 2): [None, 1e10, 2e10],
        ("w48", 0): [None, 1e10, 2e10],
    }
    stable = {(r.size, r.seed): r.max_steps for r in runs if r.branch_step is None}
    branch = {(r.seed, r.budget): r.branch_step for r in runs if r.size == "w32" and r.branch_step is not None}
    assert stable[("w32", 1)] == stable[("w32", 2)] == branch[(0, 2e10)] < stable[("w32", 0)] == branch[(0, 4e10)]
    with pytest.raises(StudyError, match="w32's smallest budget is 1e"):
        plan_isoflop(
            "recipes/tiny_cpu.yaml", ["standard"], grid, {"*": 1, "w32": 2}, 0.2, rates, 0.1, over, 10, 50, None, None,
            {"w32": 5e9},
        )  # fmt: skip
    with pytest.raises(StudyError, match="is not a budget in FLOPs. Fix: SIZE=K or SIZE=K@FLOPS"):
        more_seeds("w32=3@lots")


def test_a_tiny_grid_trains_and_its_rows_carry_the_budget(corpus, tmp_path):
    _, over = corpus
    out, rows = tmp_path / "iso", tmp_path / "rows.jsonl"
    args = [
        "isoflop",
        "--recipe",
        "recipes/tiny_cpu.yaml",
        "--variants",
        "standard",
        "--grid",
        "1e10=w32:w48,2e10=w32:w48",
    ]
    args += ["--lr-from", lr_json(tmp_path / "lr.json"), "--min-steps", "3", "--max-epochs", "50", "--jobs", "2"]
    args += ["--out", str(out), "--rows", str(rows), *over, "train.eval_every_steps=1000", "train.eval_batches=2"]
    assert main([*args, "--plan-only"]) == 0 and not rows.exists()
    assert main(args) == 0
    logged = read_rows(rows)
    branches = [r for r in logged if r.get("budget")]
    assert sorted((r["size"], r["budget"]) for r in branches) == [
        ("w32", 1e10),
        ("w32", 2e10),
        ("w48", 1e10),
        ("w48", 2e10),
    ]
    for r in branches:
        assert r["cooled"] and abs(r["flops"] / r["budget"] - 1) < 0.15 and r["lr"] == 4e-3
        assert (r["device"], r["precision"]) == ("cpu", "fp32")
    assert main(["profiles", "--rows", str(rows), "--out", str(tmp_path / "prof"), "--boot", "5"]) == 0
    md = (tmp_path / "prof" / "profiles.md").read_text()
    assert "not identified: 2 sizes" in md and "standard nan from none yet" in md


def test_a_grid_split_across_machines_trains_its_chains_and_merges_whole_ones(corpus, tmp_path, capsys):
    """--chains keeps a share of the plan (a kernel choice such as a GPU's MixiT product keeps the rate);
    `merge` appends another machine's rows of finished chains only, once, and never a chain whose last
    branch is missing."""
    _, over = corpus
    rates = transfer_rates(lr_json(tmp_path / "lr.json"))
    gpu = [*over, "model.mixit_impl=dense", "model.attn_impl=sdpa"]  # kernels, not the model: the rate serves
    grid = parse_grid("1e10=w32:w48,2e10=w32:w48")
    runs = plan_isoflop("recipes/tiny_cpu.yaml", ["standard", "mixit"], grid, {"*": 2}, 0.2, rates, 0.1, gpu, 10, 50)
    share = only_chains(runs, ["mixit-w48", "standard-w32-s1"])  # every seed's chain, or one seed's
    assert {(r.variant, r.size, r.seed) for r in share} == {
        ("mixit", "w48", 0),
        ("mixit", "w48", 1),
        ("standard", "w32", 1),
    }
    assert len(share) == 9
    with pytest.raises(StudyError, match="--chains mixit-w64: not in the grid's plan"):
        only_chains(runs, ["mixit-w64"])
    with pytest.raises(StudyError, match="measured on another model"):  # a model key still refuses it
        plan_isoflop("recipes/tiny_cpu.yaml", ["mixit"], grid, {}, 0.2, rates, 0.1, [*over, "model.mixit_seed=7"])

    rows, theirs = tmp_path / "rows.jsonl", tmp_path / "share.jsonl"
    append_row(rows, {"run": "standard-w48-s0", "steps": 40, "branch_step": None})
    whole = [("standard-w32-s0", 20, None), ("standard-w32-s0-b10", 12, 10), ("standard-w32-s0-b20", 24, 20)]
    cut = [("mixit-w48-s0", 30, None), ("mixit-w48-s0-b15", 18, 15)]  # its b30 branch never finished
    for run, steps, branch in [*whole, *cut, ("standard-w48-s0", 40, None)]:
        append_row(theirs, {"run": run, "steps": steps, "branch_step": branch, "device": "cuda"})
    assert merge_share(rows, theirs) == (["standard-w32-s0"], ["mixit-w48-s0"])
    assert merge_share(rows, theirs) == ([], ["mixit-w48-s0"])  # taken once
    merged = read_rows(rows)
    assert [r["run"] for r in merged] == ["standard-w48-s0", *(w[0] for w in whole)]
    assert "device" not in merged[0] and all(r["device"] == "cuda" for r in merged[1:])
    check = tmp_path / "check.jsonl"  # a device check's rows: only the chain named, from a share of the grid
    append_row(check, {"run": "mixit-w64-s0", "steps": 30, "branch_step": None})
    assert merge_share(check, theirs, ["standard-w32-s0"]) == (["standard-w32-s0"], [])
    assert [r["run"] for r in read_rows(check)] == ["mixit-w64-s0", *(w[0] for w in whole)]
    assert main(["merge", "--rows", str(check), "--share", str(theirs), "--chains", "standard-w64-s0"]) != 0
    assert capsys.readouterr().err.startswith("error: --chains standard-w64-s0: not in ")
    assert main(["merge", "--rows", str(tmp_path / "absent.jsonl"), "--share", str(theirs)]) != 0
    assert capsys.readouterr().err.startswith("error: ") and not (tmp_path / "absent.jsonl").exists()


def test_a_merged_chains_runs_the_grid_already_holds_go_to_the_repeats_once(tmp_path):
    """A chain trained again to larger budgets (its own --out) holds runs the grid has: those trained to the
    same step go to the repeats' log (a device check), once; a stable run of the same name but another length
    is neither appended nor a repeat; the new branches are appended."""
    rows, theirs, repeats = tmp_path / "rows.jsonl", tmp_path / "share.jsonl", tmp_path / "check.jsonl"
    for run, steps, branch in [("standard-w32-s1", 10, None), ("standard-w32-s1-b10", 12, 10)]:
        append_row(rows, {"run": run, "steps": steps, "branch_step": branch, "device": "cuda"})
    chain = [("standard-w32-s1", 20, None), ("standard-w32-s1-b10", 12, 10), ("standard-w32-s1-b20", 24, 20)]
    for run, steps, branch in chain:
        append_row(theirs, {"run": run, "steps": steps, "branch_step": branch, "device": "cpu"})
    for _ in range(2):
        assert merge_share(rows, theirs, repeats_path=repeats)[0] in (["standard-w32-s1"], [])
    assert [(r["run"], r["device"]) for r in read_rows(rows)] == [
        ("standard-w32-s1", "cuda"), ("standard-w32-s1-b10", "cuda"), ("standard-w32-s1-b20", "cpu"),
    ]  # fmt: skip
    assert [(r["run"], r["device"]) for r in read_rows(repeats)] == [("standard-w32-s1-b10", "cpu")]


def test_one_naming_rule_names_runs_and_finds_their_chains():
    """A plan's names, a row's parsed fields and a merge's chains all come from `run_name`: a branch's chain
    is its stable run, and a name outside the rule is its own chain."""
    branch = LadderRun("frozen_qk", "w64", 2, 3000, 2462)
    assert branch.name == run_name("frozen_qk", "w64", 2, 2462) == "frozen_qk-w64-s2-b2462"
    assert branch.stable_name == chain_name(branch.name) == chain_name(branch.stable_name) == "frozen_qk-w64-s2"
    m = RUN_NAME.match(branch.name)
    assert (m["variant"], m["size"], m["seed"], m["branch"]) == ("frozen_qk", "w64", "2", "2462")
    assert run_name("mixit", "w48") == "mixit-w48" and chain_name("standard-w32-lr0.01") == "standard-w32-lr0.01"
