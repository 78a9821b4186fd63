"""The scaling ladder: one stable-phase run per (variant, size, seed), and cooldown branches from its
checkpoints that give the loss at several token budgets from that one run.

A stable run trains the recipe (`optim.decay: constant` after warmup) to the step of its largest
budget and saves a checkpoint at every branch step. A branch resumes one of those checkpoints into
its own run dir (weights, optimizer, data position: exactly like any resume) and decays over a
`cooldown` fraction of the steps before it (wsd's 1-sqrt decay to min_lr), so budget k costs
S_k * (1 + cooldown) steps and the stable run is shared by all of them.

Budgets are in tokens per non-embedding parameter of the standard variant at that shape (the same
token counts for every variant of a size); `max_tokens` drops the budgets a CPU cannot afford at
the larger sizes. Finished runs carry `sweep_done.json` and are skipped; interrupted ones resume.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from common.constants import REPO_ROOT
from common.errors import StudyError
from model import ModelConfig, param_count
from pretrain.config import load_recipe

from ..shared import check_variants
from .runs import (
    DONE,
    SLURM_REQUEUE,
    RowLog,
    collect_run,
    run_chains,
    run_name,
    threads_per_job,
    tracker_overrides,
    train_once,
    write_array_script,
)

# name -> model shape (intermediate = 3 x hidden, head dim 16, tied head): 27k .. 2.0M non-embedding
# parameters of the standard variant, 75x; MixiT has ~15% fewer (no Q, K).
LADDER: dict[str, dict[str, int]] = {
    "n27k": dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=96),
    "n90k": dict(hidden_size=48, num_layers=3, num_heads=3, intermediate_size=144),
    "n214k": dict(hidden_size=64, num_layers=4, num_heads=4, intermediate_size=192),
    "n600k": dict(hidden_size=96, num_layers=5, num_heads=6, intermediate_size=288),
    "n1280k": dict(hidden_size=128, num_layers=6, num_heads=8, intermediate_size=384),
    "n2000k": dict(hidden_size=160, num_layers=6, num_heads=10, intermediate_size=480),
}
# The IsoFLOP grid's widths (studies/scaling/isoflop.py): depth 4, head dim 16, intermediate 3 x width, so
# only the width changes and µP's width rule carries a rate from one size to the next; 13k .. 13.6M
# non-embedding parameters (52 width^2).
WIDTHS: dict[str, dict[str, int]] = {
    f"w{w}": dict(hidden_size=w, num_layers=4, num_heads=w // 16, intermediate_size=3 * w)
    for w in (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
}
SHAPES = {**LADDER, **WIDTHS}


def branch_overrides(step: int, fraction: float) -> list[str]:
    """Recipe overrides of a cooldown branch resumed from a stable run's checkpoint at `step`: the wsd
    schedule's 1-sqrt decay to min_lr over round(fraction * step) steps (at least one)."""
    if step < 1 or not 0 < fraction <= 1:
        raise StudyError(f"a cooldown branch needs a step >= 1 and a fraction in (0, 1], got {step} and {fraction}")
    decay = max(1, round(fraction * step))
    return ["optim.decay=wsd", f"optim.decay_start={step}", f"train.max_steps={step + decay}", "train.max_tokens=null"]


def shape_overrides(size: str) -> list[str]:
    if size not in SHAPES:
        raise StudyError(f"unknown ladder size {size!r}. Fix: choose from {list(SHAPES)}")
    return ["model.preset=tiny"] + [f"model.{k}={v}" for k, v in SHAPES[size].items()]


def non_embedding_params(size: str, variant: str = "standard") -> int:
    """Parameters outside the embedding and the head (which the tied head shares)."""
    counts = param_count(ModelConfig(**SHAPES[size], vocab_size=256, variant=variant, tie_embeddings=True))
    return counts["non_embedding"] - counts["head"]


@dataclass
class LadderRun:
    variant: str
    size: str
    seed: int
    max_steps: int  # the stable run's last step, or the branch's
    branch_step: int | None = None  # None: the stable run
    checkpoint_every: int = 0
    lr: float | None = None  # None: the recipe's optim.lr
    batch: int | None = None  # global batch in sequences; None: the recipe's
    tokens_per_step: int = 0
    min_lr: float | None = None  # None: the recipe's optim.min_lr
    budget: float | None = None  # an IsoFLOP branch's compute budget (FLOPs), recorded in its row
    flops_per_token: float | None = None  # training FLOPs per token; None: planned by parameters (the ladder)
    extra: tuple[str, ...] = ()  # the variant's own overrides (isoflop --variant-override), in its row too

    @property
    def cost(self) -> float:
        """Planning cost: the run's own steps' tokens times its FLOPs per token (the ladder: the size's
        parameters, proportional to them)."""
        steps = self.max_steps - (self.branch_step or 0)
        return steps * self.tokens_per_step * (self.flops_per_token or non_embedding_params(self.size))

    @property
    def stable_name(self) -> str:
        return run_name(self.variant, self.size, self.seed)

    @property
    def name(self) -> str:
        return run_name(self.variant, self.size, self.seed, self.branch_step)

    def overrides(self, cooldown: float) -> list[str]:
        out = [*self.extra, *shape_overrides(self.size), f"model.variant={self.variant}", f"seed={self.seed}"]
        out.append(f"name={self.name}")
        if self.lr is not None:
            out.append(f"optim.lr={self.lr:.6g}")
        if self.min_lr is not None:
            out.append(f"optim.min_lr={self.min_lr:.6g}")
        if self.batch is not None:
            out += [f"train.global_batch_sequences={self.batch}", f"train.micro_batch_sequences={self.batch}"]
        if self.branch_step is None:
            return out + [
                f"train.max_steps={self.max_steps}",
                "train.max_tokens=null",
                f"checkpoint.every_steps={self.checkpoint_every}",
                "checkpoint.keep_last=0",
            ]
        return out + branch_overrides(self.branch_step, cooldown)


def branch_steps(n_params: int, budgets: list[float], tokens_per_step: int, cooldown: float, max_tokens: int | None):
    """The stable run's step S_k for each budget k: S_k (1 + cooldown) steps hold the budget's tokens,
    rounded to a multiple of the smallest S so the stable run saves only at branch points (every S_1
    steps). Budgets beyond `max_tokens` are dropped (the smallest one is kept, capped, when all are)."""
    tokens = [b * n_params for b in sorted(budgets)]
    kept = [t for t in tokens if max_tokens is None or t <= max_tokens] or [max_tokens]
    exact = [t / tokens_per_step / (1 + cooldown) for t in kept]
    base = max(1, round(exact[0]))
    return sorted({base * max(1, round(x / base)) for x in exact})


def plan_ladder(
    recipe: str,
    variants: list[str],
    sizes: list[str],
    seeds: dict[str, int],
    budgets: list[float],
    cooldown: float,
    max_tokens: int | None,
    overrides: list[str],
    rates: dict[str, dict[str, float]] | None = None,
    batches: dict[str, int] | None = None,
) -> list[LadderRun]:
    """Every stable run followed by its branches, in the order they can run; `rates`: lr-sweep's
    {variant: {size: lr}} (the recipe's optim.lr without it); `batches`: {size: global batch in sequences}
    (the recipe's without it), so small sizes take enough optimizer steps."""
    check_variants(variants)
    if not budgets or any(b <= 0 for b in budgets):
        raise StudyError(f"--budgets {budgets} must be positive tokens per parameter. Fix: e.g. --budgets 2.5,5,10,20")
    if not 0 < cooldown <= 1:
        raise StudyError(f"--cooldown {cooldown} must be in (0, 1]. Fix: e.g. --cooldown 0.2")
    cfg = load_recipe(recipe, overrides)  # a bad recipe or override fails here, before anything trains
    if cfg.optim.decay != "constant":
        raise StudyError(
            f"the stable runs need optim.decay=constant (the recipe has {cfg.optim.decay!r}); branches add the decay. "
            "Fix: optim.decay=constant"
        )
    rates = rates or {}
    missing = [v for v in variants if rates and v not in rates]
    if missing:
        raise StudyError(f"--lr-from has no rates for {missing}. Fix: run lr-sweep with --variants including them")
    runs = []
    for size in sizes:
        batch = (batches or {}).get(size)
        tokens_per_step = cfg.tokens_per_step if batch is None else batch * cfg.train.seq_len
        steps = branch_steps(non_embedding_params(size), budgets, tokens_per_step, cooldown, max_tokens)
        every = math.gcd(*steps)
        for variant in variants:
            lr = rates.get(variant, {}).get(size)
            for seed in range(seeds.get(size, seeds.get("*", 1))):
                runs.append(LadderRun(variant, size, seed, steps[-1], None, every, lr, batch, tokens_per_step))
                runs += [
                    LadderRun(variant, size, seed, s + max(1, round(cooldown * s)), s, 0, lr, batch, tokens_per_step)
                    for s in steps
                ]
    for run in runs:
        load_recipe(recipe, [*overrides, *run.overrides(cooldown)])
    return runs


def ladder_rates(path: str | None) -> dict[str, dict[str, float]]:
    """{variant: {size: lr}} from lr-sweep's lr.json, or {} without one."""
    if not path:
        return {}
    try:
        rule = json.loads(Path(path).read_text())
        return {v: {s: float(lr) for s, lr in r["rates"].items()} for v, r in rule.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise StudyError(
            f"--lr-from {path}: not an lr.json of lr-sweep ({e}). Fix: run studies.scaling lr-sweep"
        ) from None


def train_args(recipe: str, run: LadderRun, out: Path, cooldown: float, extra: list[str]) -> list[str]:
    run_dir = out / "runs" / run.name
    if run.branch_step is None or (run_dir / "checkpoints").is_dir():
        resume = "auto"
    else:
        resume = str(out / "runs" / run.stable_name / "checkpoints" / f"step_{run.branch_step:08d}")
    return ["--recipe", recipe, "--run-dir", str(run_dir), "--resume", resume, *extra, *run.overrides(cooldown)]


# `model.*` keys that pick a kernel, not the function it computes: a rate measured with one serves another
KERNEL_CHOICES = ("model.attn_impl", "model.mixit_impl")


def model_overrides(overrides: list[str]) -> dict[str, str]:
    """The `model.*` keys of dotted overrides, the last value of each: the model a rate was measured on
    (lr-sweep records it in lr.json; a plan on another model refuses the rate). Kernel choices are left
    out: the same model computed by another kernel (a GPU's) keeps its rate."""
    return {
        k: v for k, _, v in (o.partition("=") for o in overrides) if k.startswith("model.") and k not in KERNEL_CHOICES
    }


def per_size(spec: str | None, option: str) -> dict[str, int]:
    """`n27k=2,n214k=2` -> {size: int}."""
    out = {}
    for item in filter(None, (spec or "").split(",")):
        size, _, k = item.partition("=")
        if size not in SHAPES or not k.isdigit() or int(k) < 1:
            raise StudyError(f"{option} {item!r} must be SIZE=K with a ladder size and K >= 1. Fix: e.g. n27k=2")
        out[size] = int(k)
    return out


def run_ladder(args) -> int:
    """Train every run of the plan (or write the Slurm scripts with --slurm): each stable run and then
    its branches in order, `--jobs` such chains side by side, each finished run a row in `--rows`."""
    seeds = {"*": args.seeds, **per_size(args.more_seeds, "--more-seeds")}
    batches = per_size(args.batch_sequences, "--batch-sequences")
    variants, sizes = args.variants.split(","), args.sizes.split(",")
    budgets = [float(b) for b in args.budgets.split(",")]
    for size in sizes:
        shape_overrides(size)
    rates = ladder_rates(args.lr_from)
    runs = plan_ladder(
        args.recipe, variants, sizes, seeds, budgets, args.cooldown, args.max_tokens, args.overrides, rates, batches
    )
    return train_plan(args, runs, "ladder")


def refuse_other_rates(runs: list[LadderRun], rows: list[dict], rows_path) -> None:
    """A planned run whose name the rows hold at another rate is another plan's (run names do not carry the
    rate: the rate check's --lr-factor runs share the grid's names); skipping it as done would be silent."""
    planned = {r.name: r.lr for r in runs if r.lr is not None}
    for row in rows:
        lr = planned.get(row.get("run"))
        if lr is not None and row.get("lr") is not None and not math.isclose(float(row["lr"]), lr, rel_tol=1e-5):
            raise StudyError(
                f"{rows_path} holds {row['run']} at lr {row['lr']:g}; this plan trains it at {lr:.6g}. Fix: give this "
                "plan its own --rows and --out (the rate check: docs/SCALING.md)"
            )


def train_plan(args, runs: list[LadderRun], study: str) -> int:
    """Train a plan of stable runs and their branches under `args.out` (or write the Slurm scripts with
    --slurm), each finished run a row in `args.rows`; `study` names the plan file and the trackers' group."""
    out = Path(args.out)
    args.overrides += tracker_overrides(args.recipe, args.overrides, f"{study}:{out.name}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / f"{study}.json").write_text(json.dumps({**vars(args), "runs": [r.__dict__ for r in runs]}, indent=2))
    if args.slurm:
        return write_slurm(args, runs, out)
    log, threads = RowLog(args.rows), threads_per_job(args.jobs)
    rows = log.rows()
    refuse_other_rates(runs, rows, args.rows)
    have = {r["run"] for r in rows}
    chains: dict[str, list[LadderRun]] = {}
    for run in runs:
        chains.setdefault(run.stable_name, []).append(run)

    def train_chain(chain: list[LadderRun]) -> list[str]:
        """The stable run, then its branches; the stable run trains again only when a branch still needs
        its checkpoints and they are gone; a failed stable run skips its branches."""
        if all(r.name in have for r in chain):
            return []
        for run in chain:
            run_dir = out / "runs" / run.name
            if run.branch_step is not None and run.name in have:
                continue
            if not (run_dir / DONE).is_file():
                targs = train_args(args.recipe, run, out, args.cooldown, args.overrides)
                print(f"[{study}] {run.name}: {shlex.join(targs)}", flush=True)
                if not train_once(targs, run_dir, {"run": run.__dict__}, threads):
                    print(f"[{study}] {run.name} failed; re-run the same command to resume it", flush=True)
                    return [run.name]
            if run.name not in have and (row := collect_run(run_dir)) is not None:
                extra = {"variant_overrides": list(run.extra)} if run.extra else {}
                log.append({**row, **extra} if run.budget is None else {**row, **extra, "budget": run.budget})
        return []

    # side by side, the costliest chains first, so the workers finish close together
    order = sorted(chains.values(), key=lambda c: -sum(r.cost for r in c)) if args.jobs > 1 else chains.values()
    failed = run_chains([lambda c=c: train_chain(c) for c in order], args.jobs)
    if failed:
        print(f"[{study}] {len(failed)} run(s) failed: {', '.join(failed)}")
        return 1
    after = f"profiles --rows {args.rows} --out {out}" if study == "isoflop" else f"collect --out {out}"
    print(f"[{study}] all {len(runs)} runs done; next: python -m studies.scaling {after}")
    return 0


def write_slurm(args, runs: list[LadderRun], out: Path) -> int:
    """ladder.sbatch (an array over the stable runs) and submit.sh, which submits it and then every
    branch as its own job after its stable run's array task (afterok)."""
    stable = [r for r in runs if r.branch_step is None]
    index = {r.name: i for i, r in enumerate(stable)}
    lines = [shlex.join(train_args(args.recipe, r, out, args.cooldown, args.overrides)) for r in stable]
    write_array_script(out / "ladder.sbatch", "ladder-stable", lines, out / "stable.txt", "stable run")
    submit = [
        "#!/bin/bash",
        "set -euo pipefail",
        f"cd {REPO_ROOT}",
        f"STABLE=$(sbatch --parsable {out / 'ladder.sbatch'})",
    ]
    for r in runs:
        if r.branch_step is not None:
            cmd = "exec " + shlex.join(
                ["./launch.sh", "--slurm", "--", *train_args(args.recipe, r, out, args.cooldown, args.overrides)]
            )
            submit.append(
                f"sbatch --job-name={r.name} {' '.join(SLURM_REQUEUE)} "
                f"--dependency=afterok:${{STABLE}}_{index[r.stable_name]} "
                f"--output={out.resolve()}/runs/slurm-{r.name}.out --wrap {shlex.quote(cmd)}"
            )
    (out / "submit.sh").write_text("\n".join(submit) + "\n")
    print(
        f"wrote {out / 'ladder.sbatch'} ({len(stable)} stable runs) and {out / 'submit.sh'} "
        f"({len(runs) - len(stable)} branches); submit with: bash {out / 'submit.sh'}"
    )
    return 0
