"""IsoFLOP profiles (Hoffmann et al.'s approach 2): at each compute budget C, several widths trained to
exactly C FLOPs each, so the loss-optimal size at C is read from one profile, not from a fit.

The design rules, each checked before anything trains:
- Only the width changes (`WIDTHS`: depth 4, head dim 16); under µP one rate per variant (the transfer
  check's, `lr.json`'s `transfer.rate`) serves every width, so no rate is extrapolated. A variant whose
  check failed trains only when `--per-width-rates` names it: each width at a rate log-linear in log
  width through the check's two optima (held at them outside their widths). The rate was
  measured on one model: its `model.*` overrides (lr.json's `model_overrides`) must be the grid's for that
  variant (`--variant-override` adds a variant's own, e.g. MixiT's plain residual), else it is refused.
- One global batch in tokens for every run (the recipe's or `--batch-sequences`), and `min_lr` a fixed
  fraction of the peak rate: neither moves with the size.
- A run's compute is its variant's own training FLOPs per token (model.flops: MixiT without Q/K, frozen
  Q/K without their weight gradients) times its tokens: each variant's profile is iso in its own FLOPs.
- Budgets within a (variant, size) are whole multiples of its smallest one, so one stable run (constant
  rate after warmup) saves a checkpoint every S_1 steps and each budget is a cooldown branch from the
  checkpoint at its step: S_k (1 + cooldown) steps at the batch hold C_k's tokens to within m_k/2 + 1/2
  steps (S_1 rounds to a whole step; C_k = m_k C_1), under 0.3 % of a run of >= 500 steps.
- Every run takes >= `--min-steps` optimizer steps (500) and reads <= `--max-epochs` (4) passes over
  the training shards; a grid that breaks either is refused with the size and budget that break it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from common.errors import StudyError
from data_pipeline.config import DataConfig
from data_pipeline.shards import read_manifest
from model.flops import flops_per_token
from pretrain.config import load_recipe
from pretrain.dry_run import resolve_model

from ..shared import check_variants
from .ladder import (
    SHAPES,
    WIDTHS,
    LadderRun,
    ladder_rates,
    model_overrides,
    per_size,
    shape_overrides,
    train_plan,
)
from .runs import run_name


@dataclass(frozen=True)
class TransferRate:
    """A variant's rate from its transfer check, and the model it was measured on."""

    rate: float
    model: dict[str, str] | None  # lr.json's `model_overrides`; None: a file written before they were recorded
    source: str
    optima: dict[str, float] | None = None  # a failed check's best rate per width: the rate then moves with it

    def scaled(self, factor: float) -> "TransferRate":
        """The same rule at `factor` times every rate: a check of the rate at the longest horizon."""
        optima = {k: factor * v for k, v in self.optima.items()} if self.optima else None
        return TransferRate(factor * self.rate, self.model, self.source, optima)

    def at(self, size: str) -> float:
        """The rate `size` trains at: the one rate, or log-linear in log width through the two optima."""
        if self.optima is None:
            return self.rate
        (narrow, lo), (wide, hi) = sorted(self.optima.items(), key=lambda kv: SHAPES[kv[0]]["hidden_size"])
        x = math.log(SHAPES[size]["hidden_size"] / SHAPES[narrow]["hidden_size"])
        span = math.log(SHAPES[wide]["hidden_size"] / SHAPES[narrow]["hidden_size"])
        return lo * (hi / lo) ** min(1.0, max(0.0, x / span))


def parse_grid(spec: str) -> dict[float, list[str]]:
    """`1e13=w32:w128,2e13=w48:w192` -> {budget FLOPs: the widths from the first to the last, in order}."""
    grid: dict[float, list[str]] = {}
    names = list(WIDTHS)
    for item in filter(None, spec.split(",")):
        budget, _, span = item.partition("=")
        first, _, last = span.partition(":")
        try:
            flops = float(budget)
        except ValueError:
            flops = -1.0
        if flops <= 0 or first not in WIDTHS or (last or first) not in WIDTHS:
            raise StudyError(
                f"--grid item {item!r} must be FLOPS=FIRST:LAST with FLOPS > 0 and widths from {names}. "
                "Fix: e.g. --grid 1e13=w32:w128,2e13=w48:w192"
            )
        lo, hi = names.index(first), names.index(last or first)
        if lo > hi:
            raise StudyError(f"--grid item {item!r}: {first} is wider than {last}. Fix: narrowest first")
        grid[flops] = names[lo : hi + 1]
    if not grid:
        raise StudyError("--grid is empty. Fix: e.g. --grid 1e13=w32:w128,2e13=w32:w192")
    return dict(sorted(grid.items()))


def train_tokens(cfg) -> int:
    """Tokens in the recipe's training shards (the epoch rule's denominator); an error before any work
    when they are not prepared, since a plan without them would count the wrong vocabulary's FLOPs."""
    source = getattr(cfg.data, "source", None)
    if not isinstance(cfg.data, DataConfig) or source == "mixture":
        raise StudyError(
            f"an IsoFLOP grid trains on one prepared shard directory; the recipe's data is {source!r}. Fix: data.source=DIR"
        )
    try:
        return int(read_manifest(source)["num_tokens"])
    except Exception as e:  # noqa: BLE001 - DataError or a bad manifest: one line either way
        raise StudyError(f"{source}: {e}. Fix: prepare the data first (docs/SCALING.md, Commands)") from None


def plan_isoflop(
    recipe: str,
    variants: list[str],
    grid: dict[float, list[str]],
    seeds: dict[str, int],
    cooldown: float,
    rates: dict[str, TransferRate],
    min_lr_fraction: float,
    overrides: list[str],
    min_steps: int = 500,
    max_epochs: float = 4.0,
    standard_grid: dict[float, list[str]] | None = None,
    variant_overrides: dict[str, list[str]] | None = None,
    seed_caps: dict[str, float] | None = None,
) -> list[LadderRun]:
    """Each (variant, size, seed)'s stable run followed by a branch per budget of the grid that holds the
    size, in the order they can run; `standard_grid`: budgets standard alone also trains, so that its
    L*(C) reaches the losses of the weaker variants (the compute multiplier reads it there);
    `variant_overrides`: a variant's own overrides, after the grid's; `seed_caps`: {size: budget}, where the
    seeds beyond `seeds["*"]` stop (their stable run ends at that budget's branch step), since a size needs
    seeds only at the budgets where it is a minimum or its neighbour."""
    check_variants(variants)
    own = variant_overrides or {}
    if not 0 < cooldown <= 1:
        raise StudyError(f"--cooldown {cooldown} must be in (0, 1]. Fix: e.g. --cooldown 0.2")
    if not 0 < min_lr_fraction <= 1:
        raise StudyError(f"--min-lr-fraction {min_lr_fraction} must be in (0, 1]. Fix: e.g. 0.1")
    missing = [v for v in variants if v not in rates]
    if missing:
        raise StudyError(
            f"no rate for {missing}. Fix: --lr-from an lr.json whose transfer check swept them (lr-sweep under µP)"
        )
    for v in variants:
        check_rate_model(v, rates[v], model_overrides([*overrides, *own.get(v, [])]))
    cfg = load_recipe(recipe, overrides)
    if cfg.optim.decay != "constant":
        raise StudyError(
            f"the stable runs need optim.decay=constant (the recipe has {cfg.optim.decay!r}). Fix: optim.decay=constant"
        )
    epoch = train_tokens(cfg)
    batch = cfg.tokens_per_step
    runs = []
    # size-major, narrowest first: the variants' chains of a size finish together, so a partial grid
    # compares the variants on the same sizes
    grids = {v: {**grid, **(standard_grid or {})} if v == "standard" else grid for v in variants}
    grids = {v: dict(sorted(g.items())) for v, g in grids.items()}
    every = {s for g in grids.values() for sizes in g.values() for s in sizes}
    widths = sorted(every, key=lambda s: SHAPES[s]["hidden_size"])
    for size, variant in ((s, v) for s in widths for v in variants):
        shape = [*overrides, *own.get(variant, []), *shape_overrides(size), f"model.variant={variant}"]
        run_cfg = load_recipe(recipe, shape)
        fpt = flops_per_token(resolve_model(run_cfg)[0], run_cfg.train.seq_len)["train"]
        budgets = [c for c, sizes in grids[variant].items() if size in sizes]
        if not budgets:
            continue
        multiples = [c / budgets[0] for c in budgets]
        if any(abs(m - round(m)) > 1e-6 for m in multiples):
            raise StudyError(
                f"{size}'s budgets {[f'{c:.3g}' for c in budgets]} are not whole multiples of the smallest, so one "
                "stable run cannot branch at each. Fix: budgets C_1 x 1, 2, 4, ..."
            )
        base = round(budgets[0] / (fpt * batch * (1 + cooldown)))
        steps = [base * round(m) for m in multiples]
        for c, s in zip(budgets, steps):
            total = s + max(1, round(cooldown * s))
            if total < min_steps:
                raise StudyError(
                    f"{variant} {size} at {c:.3g} FLOPs trains {total} steps of {batch} tokens, fewer than "
                    f"--min-steps {min_steps}. Fix: drop {size} from that budget or lower the batch"
                )
            if total * batch > max_epochs * epoch:
                raise StudyError(
                    f"{variant} {size} at {c:.3g} FLOPs reads {total * batch / epoch:.1f} passes over the "
                    f"{epoch:,} training tokens, more than --max-epochs {max_epochs:g}. Fix: drop {size} from that budget"
                )
        lr = rates[variant].at(size)
        first = seeds.get("*", 1)
        for seed in range(seeds.get(size, first)):
            common = dict(lr=lr, min_lr=lr * min_lr_fraction, tokens_per_step=batch, flops_per_token=fpt)
            common["extra"] = tuple(own.get(variant, []))
            cap = (seed_caps or {}).get(size) if seed >= first else None
            kept = [(c, s) for c, s in zip(budgets, steps) if cap is None or c <= cap * (1 + 1e-9)]
            if not kept:
                raise StudyError(
                    f"--more-seeds {size}=...@{cap:.3g}: {size}'s smallest budget is {budgets[0]:.3g}. Fix: a budget "
                    f"of its grid, {', '.join(f'{c:.3g}' for c in budgets)}"
                )
            runs.append(LadderRun(variant, size, seed, kept[-1][1], None, base, **common))
            runs += [
                LadderRun(variant, size, seed, s + max(1, round(cooldown * s)), s, 0, budget=c, **common)
                for c, s in kept
            ]
    for run in runs:  # every run's recipe loads, before anything trains
        load_recipe(recipe, [*overrides, *run.overrides(cooldown)])
    return runs


def check_rate_model(variant: str, rate: TransferRate, model: dict[str, str]) -> None:
    """The grid trains `variant` on the model its rate was measured on (the same `model.*` overrides)."""
    if rate.model is None:
        raise StudyError(
            f"{rate.source} does not record the model its {variant} rate was measured on. Fix: run its lr-sweep "
            "command again (it trains nothing whose rows exist and rewrites lr.json with the record)"
        )
    differ = sorted(k for k in {*rate.model, *model} if rate.model.get(k) != model.get(k))
    if differ:
        said = ", ".join(f"{k}: {rate.model.get(k, '(recipe)')} there, {model.get(k, '(recipe)')} here" for k in differ)
        raise StudyError(
            f"{variant}'s rate in {rate.source} was measured on another model ({said}). Fix: the grid's overrides "
            f"(and --variant-override {variant}:KEY=VALUE) as the lr-sweep had them, or a transfer check of this model"
        )


def transfer_rates(spec: str, variants: list[str] | None = None, per_width: list[str] = ()) -> dict[str, TransferRate]:
    """{variant: its TransferRate} from `PATH[,VARIANT=PATH...]`: lr.json files of transfer checks, the
    first for every variant, a `VARIANT=PATH` for that variant alone; only `variants` (default: all the
    files hold) are read, and a failed check of one of them is an error (its rate would not carry across
    the widths) unless `per_width` names it (a rate per width, `TransferRate.at`); `per_width` naming a
    variant whose check held is an error too (one rate serves it)."""
    if not spec:
        raise StudyError("--lr-from is required: the transfer check's lr.json. Fix: run lr-sweep under µP first")
    default, *named = spec.split(",")
    sources = {v: path for v, _, path in (item.partition("=") for item in named)}
    check_variants(list(sources))
    rates = {}
    for path in [default, *sources.values()]:
        ladder_rates(path)  # a file that is not an lr.json fails here, with its own message
        rule = json.loads(Path(path).read_text())
        for variant, r in rule.items():
            if (variants is not None and variant not in variants) or sources.get(variant, default) != path:
                continue
            check = r.get("transfer")
            if check is None:
                continue
            if check["holds"] == (variant in per_width):
                moves = (
                    f"{variant}'s best rate moves {check['rate_ratio']:.2f}x from {check['narrow']} to {check['wide']}"
                )
                raise StudyError(
                    f"{path}: {moves}, within sqrt(2), so one rate serves every width. Fix: drop {variant} from "
                    "--per-width-rates"
                    if check["holds"]
                    else f"{path}: {moves}, beyond sqrt(2), so one rate does not serve every width. Fix: check µP "
                    f"first, or --per-width-rates {variant} for a rate per width through the two optima"
                )
            optima = (
                {k: float(r["best"][k]) for k in (check["narrow"], check["wide"])} if variant in per_width else None
            )
            rates[variant] = TransferRate(float(check["rate"]), r.get("model_overrides"), path, optima)
    unknown = sorted(set(per_width) - set(rates))
    if unknown:
        raise StudyError(f"--per-width-rates {','.join(unknown)}: no transfer check of it in --lr-from. Fix: drop it")
    return rates


def more_seeds(spec: str) -> tuple[dict[str, int], dict[str, float]]:
    """`w48=3@4.4e13,w64=3` -> ({size: seeds}, {size: the budget its extra seeds stop at})."""
    counts, caps = {}, {}
    for item in filter(None, spec.split(",")):
        head, _, cap = item.partition("@")
        counts.update(per_size(head, "--more-seeds"))
        if cap:
            try:
                caps[head.partition("=")[0]] = float(cap)
            except ValueError:
                raise StudyError(
                    f"--more-seeds {item!r}: {cap!r} is not a budget in FLOPs. Fix: SIZE=K or SIZE=K@FLOPS, e.g. w48=3@4.4e13"
                ) from None
    return counts, caps


def parse_variant_overrides(items: list[str]) -> dict[str, list[str]]:
    """`mixit:model.mixit_residual_scale=null` (repeatable) -> {variant: [override, ...]}."""
    out: dict[str, list[str]] = {}
    for item in items:
        variant, _, override = item.partition(":")
        if "=" not in override:
            raise StudyError(
                f"--variant-override {item!r} must be VARIANT:KEY=VALUE. Fix: e.g. mixit:model.mixit_residual_scale=null"
            )
        out.setdefault(variant, []).append(override)
    check_variants(list(out))
    return out


def plan_summary(runs: list[LadderRun]) -> str:
    """Every run with its own steps and budget, and the FLOPs each variant's plan costs."""
    lines = [
        f"{r.name}: {r.max_steps - (r.branch_step or 0)} steps" + (f", budget {r.budget:.3g} FLOPs" if r.budget else "")
        for r in runs
    ]
    for variant in sorted({r.variant for r in runs}):
        own = [r for r in runs if r.variant == variant]
        lines.append(f"{variant}: {len(own)} runs, {sum(r.cost for r in own):.3g} FLOPs")
    return "\n".join(lines)


def run_isoflop(args) -> int:
    grid = parse_grid(args.grid)
    standard_grid = parse_grid(args.standard_grid) if args.standard_grid else None
    more, caps = more_seeds(args.more_seeds)
    seeds = {"*": args.seeds, **more}
    if not (math.isfinite(args.lr_factor) and args.lr_factor > 0):
        raise StudyError(f"--lr-factor {args.lr_factor:g} must be positive. Fix: e.g. --lr-factor 0.5")
    rates = transfer_rates(
        args.lr_from, args.variants.split(","), args.per_width_rates.split(",") if args.per_width_rates else []
    )
    runs = plan_isoflop(
        args.recipe,
        args.variants.split(","),
        grid,
        seeds,
        args.cooldown,
        {v: r.scaled(args.lr_factor) for v, r in rates.items()},
        args.min_lr_fraction,
        args.overrides,
        args.min_steps,
        args.max_epochs,
        standard_grid,
        parse_variant_overrides(args.variant_override),
        caps,
    )
    if args.chains:
        runs = only_chains(runs, args.chains.split(","))
    if args.plan_only:
        print(plan_summary(runs))
        return 0
    return train_plan(args, runs, "isoflop")


def only_chains(runs: list[LadderRun], names: list[str]) -> list[LadderRun]:
    """The runs of the chains named `VARIANT-SIZE` (every seed's) or `VARIANT-SIZE-sSEED` (one seed's: a
    stable run and its branches): a grid split across machines, each training its share into its own
    rows; a name the plan lacks is an error."""
    planned = {run_name(r.variant, r.size) for r in runs} | {r.stable_name for r in runs}
    unknown = [n for n in names if n not in planned]
    if unknown:
        raise StudyError(
            f"--chains {','.join(unknown)}: not in the grid's plan. Fix: VARIANT-SIZE or VARIANT-SIZE-sSEED names "
            f"of it, e.g. {', '.join(sorted(planned)[:3])}"
        )
    return [r for r in runs if run_name(r.variant, r.size) in names or r.stable_name in names]
