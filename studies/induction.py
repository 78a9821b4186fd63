"""Induction heads vs training step on real text: does a Llama whose Q/K stay frozen still form them?

    python -m studies.induction --out outputs/induction --seeds 3                 # 2 layers x 3 variants x 3 seeds
    python -m studies.induction --out outputs/induction --layers 3 --seeds 1      # add 3-layer runs to the same figure
    python -m studies.induction --recipe recipes/induction_copy.yaml --out outputs/induction_copy --seeds 3
    python -m studies.induction --smoke --out /tmp/induction                       # seconds: the pipeline only
    python -m studies.induction --recipe recipes/induction_docs.yaml --out outputs/induction_docs --seeds 2 \
        --rows docs/data/induction/runs.jsonl      # the docs corpus (prepared shards), one data row per run

Trains `standard`, `frozen_qk` and `mixit` models on WikiText-2 (recipes/induction_wikitext2.yaml, a
256-token context) tokenized by a byte-fallback BPE of --vocab-size pieces that the study trains and
prepares into shards under OUT/data (once; `--bytes`: raw bytes), with the trainer's hooks running
eval's probes every `train.eval_every_steps` (InductionProbe): every head's induction and
previous-token scores (MixiT: its fixed map) on repeated random tokens and on repeated chunks of the
held-out text, the repeated text scored as a behaviour, and Olsson et al.'s in-context learning score
(loss of token ~250 minus loss of token ~25; more negative = more use of the context). The held-out
text is the tail `data.val_fraction` of the stream, never trained on. A synthetic source
(recipes/induction_copy.yaml: a span copied at a varying distance) gets the random-token probes only;
a shard source (recipes/induction_docs.yaml) is trained on as it is, and with `val_fraction: 0` the
probes read the first of its `data.val_sets`.
The study plots every run against step (OUT/induction.png) and writes OUT/induction.md: per (variant,
layers) the final values as mean ± std over seeds, and the largest drop of the ICL score between two
evaluations (the phase change, where there is one). `--rows FILE` also writes one JSON row per
finished run (its command, seed, rate and every evaluation's scalars), which docs/results/induction.md
is rendered from. Seed i trains with the recipe's seed + i and MixiT matrices of seed i, in
OUT/runs/<variant>-L<layers>-s<i>; re-running resumes and skips finished runs.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common.cli import run_cli
from common.errors import StudyError
from data_pipeline.config import TEXT_PREFIX
from data_pipeline.prepare import prepare
from data_pipeline.storage import open_shards
from data_pipeline.synthetic import get_task
from data_pipeline.text import TextLoader, read_documents, text_files
from data_pipeline.tokenizer import train_sentencepiece
from eval.in_context import icl_score
from eval.mechanisms import mechanism_scores
from eval.report import markdown_table, new_figure, save_figure
from eval.retrieval import induction, repeated
from model import VARIANTS
from pretrain.config import load_recipe
from pretrain.metrics import read_metrics
from pretrain.run_dir import read_config
from pretrain.train import train

from .rows import replace_rows
from .shared import check_variants, names, positive_ints, ran_to_end, seed_overrides, study_parser, without
from .spread import Spread

RECIPE = "recipes/induction_wikitext2.yaml"
SYNTHETIC_PREFIX = "synthetic:"
DEFAULT_VARIANTS = ("standard", "frozen_qk", "mixit")
PRINTABLE = (32, 127)  # byte models' probe tokens: bytes a WikiText model has seen
FIRST_PIECE = 4  # BPE models' probe tokens: every piece but unk, bos, eos, pad
SMOKE = [
    "train.max_steps=4",
    "train.eval_every_steps=2",
    "train.seq_len=32",
    "model.max_seq_len=32",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "train.global_batch_sequences=4",
    "train.micro_batch_sequences=4",
    "train.eval_batches=1",
    "checkpoint.every_steps=0",
]
# what each kind of data is plotted by, one panel each (metric, title), and where its phase change shows (a drop)
METRICS = {
    "text": (
        ("probe/induction_score_text", "induction score, repeated held-out text (max head)"),
        ("probe/induction_score", "induction score, repeated random tokens (max head)"),
        ("probe/prev_token_score_text", "previous-token score, text (max head)"),
        ("probe/icl_score", "in-context learning score (loss@~250 - loss@~25)"),
        ("probe/repeat_text_loss", "repeated text: loss on the repeat (nats/token)"),
        ("val_loss", "held-out loss (nats/token)"),
    ),
    "copy": (
        ("probe/induction_score", "induction score, repeated random tokens (max head)"),
        ("probe/prev_token_score", "previous-token score, random tokens (max head)"),
        ("probe/repeat_random_loss", "repeated random tokens: loss on the repeat (nats/token)"),
        ("probe/repeat_random_acc", "repeated random tokens: accuracy on the repeat"),
        ("val_loss", "held-out loss on the copies (nats/token)"),
    ),
}
# the probes' final values a `summarize` row keeps (as probe/KEY in the metrics)
FINAL_KEYS = {
    "text": ("icl_score", "induction_score", "induction_score_text", "prev_token_score_text", "repeat_text_acc"),
    "copy": ("induction_score", "prev_token_score", "repeat_random_acc", "repeat_random_loss"),
}
DROP_KEY = {"text": "probe/icl_score", "copy": "probe/repeat_random_loss"}


def text_halves(tokens, n: int, L: int) -> list[list[int]]:
    """n chunks of L tokens spread evenly over the held-out tokens (the same chunks at every step)."""
    step = (len(tokens) - L) // n
    if step < 1:
        raise StudyError(f"the held-out text ({len(tokens)} tokens) is too short for {n} chunks of {L}")
    return [[int(t) for t in tokens[i * step : i * step + L]] for i in range(n)]


class InductionProbe:
    """The training hook: induction scores per head, the repeat probes and the ICL score at this step;
    with no held-out text (`val_tokens` None: synthetic data), the random-token probes only."""

    repeat_len, icl_windows, samples = 64, 160, 16

    def __init__(self, val_tokens, token_range: tuple[int, int]):
        self.val_tokens, self.token_range = val_tokens, token_range

    def __call__(self, model, step: int) -> dict[str, Any]:
        L = min(self.repeat_len, model.cfg.max_seq_len // 2)
        lo, hi = self.token_range
        mech = mechanism_scores(model, L=L, n=self.samples // 2, token_range=(lo, hi))
        rnd = induction(model, (L,), n=self.samples, token_low=lo, token_high=hi, progress=False)
        out = {
            "probe/induction_score": mech["max_induction_score"],
            "probe/prev_token_score": mech["max_previous_token_score"],
            "probe/induction_score_heads": mech["induction_score"],
            "probe/prev_token_score_heads": mech["previous_token_score"],
            "probe/source": mech["source"],
            "probe/repeat_random_acc": rnd["acc"],
            "probe/repeat_random_loss": rnd["loss"],
        }
        if self.val_tokens is None:  # synthetic data: random tokens are its own distribution
            return out
        halves = text_halves(self.val_tokens, self.samples, L)
        mech_text = mechanism_scores(model, halves=halves)
        rep = repeated(model, halves)
        icl = icl_score(model, self.val_tokens, n_windows=self.icl_windows)
        return {
            **out,
            "probe/induction_score_text": mech_text["max_induction_score"],
            "probe/prev_token_score_text": mech_text["max_previous_token_score"],
            "probe/induction_score_text_heads": mech_text["induction_score"],
            "probe/prev_token_score_text_heads": mech_text["previous_token_score"],
            "probe/repeat_text_acc": rep["acc"],
            "probe/repeat_text_loss": rep["loss"],
            "probe/repeat_text_first_loss": rep["first_half_loss"],
            "probe/icl_score": icl["icl_score"],
            "probe/icl_early_loss": icl["early_loss"],
            "probe/icl_late_loss": icl["late_loss"],
        }


def run_name(variant: str, layers: int, seed_index: int) -> str:
    return f"{variant}-L{layers}-s{seed_index}"


def cell_overrides(recipe_seed: int, variant: str, layers: int, seed_index: int) -> list[str]:
    return [
        f"model.variant={variant}",
        f"model.num_layers={layers}",
        *seed_overrides(recipe_seed, seed_index),
    ]


REPEAT_STYLES = ("prefix", "span", "words")


def insert_repeat(line: str, max_chars: int, rng: random.Random) -> str:
    """`line` with a random run of its words (8 words up to ~`max_chars` characters) written again
    at a random point after the run's end, at most ~`max_chars` characters later: both copies
    usually share a 256-token window, and the distance between them varies from paragraph to
    paragraph."""
    words = line.split(" ")
    max_words = max(8, max_chars // 6)  # WikiText averages ~6 characters per space-separated word
    k = rng.randint(8, min(max_words, max(8, len(words) // 2)))
    i = rng.randint(0, max(0, len(words) - k))
    j = rng.randint(i + k, min(len(words), i + k + max_words))
    return " ".join(words[:j] + words[i : i + k] + words[j:])


def word_sampler(lines: list[str], rng: random.Random):
    """n -> n words drawn independently by their frequency in `lines` (space-separated)."""
    counts = Counter(w for line in lines for w in line.split(" ") if w)
    words = list(counts)
    cum = list(itertools.accumulate(counts[w] for w in words))
    return lambda n: rng.choices(words, cum_weights=cum, k=n)


def prepare_bpe(
    recipe: str,
    overrides: list[str],
    out: Path,
    vocab_size: int,
    repeat_fraction: float = 0.0,
    repeat_chars: int = 400,
    repeat_style: str = "prefix",
    repeat_epochs: int = 1,
    hold_fraction: float = 0.05,
) -> list[str]:
    """The recipe's text as BPE shards under OUT/data (once), and the overrides that point the recipe at them.

    Every non-blank line is a document; the last `hold_fraction` of them are held out (the trainer's
    validation tail and the probes' text) and never trained on. With `repeat_fraction` q > 0, a fraction
    q of the training paragraphs (those of >= 200 characters) get a repeat in `repeat_style` (the CLI's
    --repeat-style): real text made "bursty" (Chan et al. 2022), so that copying from the context pays
    more often than in WikiText alone. A prefix repeat sits at a near-fixed distance, which a positional
    head can exploit; a span needs an induction head. WikiText-2 is small enough that a model trained for
    many epochs memorizes where each copy sits, so `repeat_epochs` writes the paragraphs again with fresh
    spans; `words` repeats runs of random words, which no memorized text predicts."""
    cfg = load_recipe(recipe, overrides)
    source = cfg.data.source
    if not source.startswith(TEXT_PREFIX):
        raise StudyError(
            f"{recipe}: data.source={source!r} is not a text: source. Fix: point it at the raw text "
            "(the study tokenizes it), or pass --bytes"
        )
    files = [str(f) for f in text_files(source)]
    data = out / "data"
    tok = data / f"bpe{vocab_size}"
    if not (tok / "tokenizer.model").is_file():
        train_sentencepiece(files, vocab_size, tok, quiet=True)
    tag = f"bpe{vocab_size}_repeat{repeat_fraction:g}" + (f"x{repeat_chars}" if repeat_fraction > 0 else "")
    if repeat_style != "prefix" and repeat_fraction > 0:
        tag += f"_{repeat_style}" + (f"e{repeat_epochs}" if repeat_epochs > 1 else "")
    shards, held_shards = data / f"shards_{tag}", data / f"heldout_{tag}"
    if not (shards / "manifest.json").is_file() or not (held_shards / "manifest.json").is_file():
        lines = [d.decode("utf-8") for d in read_documents([Path(f) for f in files])]
        n_hold = max(1, int(len(lines) * hold_fraction))
        train_lines, held_lines = lines[:-n_hold], lines[-n_hold:]
        rng = random.Random(0)
        if repeat_fraction > 0:
            bursty = []
            draw = word_sampler(train_lines, rng) if repeat_style == "words" else None
            for _ in range(repeat_epochs if repeat_style != "prefix" else 1):
                for line in train_lines:
                    if len(line) < 200 or rng.random() >= repeat_fraction:
                        bursty.append(line)
                    elif repeat_style == "span":
                        bursty.append(insert_repeat(line, repeat_chars, rng))
                    elif repeat_style == "words":
                        bursty += [line, insert_repeat(" ".join(draw(line.count(" ") + 1)), repeat_chars, rng)]
                    else:
                        chunk = line[:repeat_chars].strip()
                        bursty += [line, f"{chunk} {chunk}"]
            train_lines = bursty
        (data / f"{tag}.txt").write_text("".join(x + "\n" for x in train_lines + held_lines), encoding="utf-8")
        (data / f"{tag}_heldout.txt").write_text("".join(x + "\n" for x in held_lines), encoding="utf-8")
        prepare([str(data / f"{tag}_heldout.txt")], str(tok), held_shards, workers=1, progress=False)
        prepare([str(data / f"{tag}.txt")], str(tok), shards, workers=1, progress=False)
    total = json.loads((shards / "manifest.json").read_text())["num_tokens"]
    held = json.loads((held_shards / "manifest.json").read_text())["num_tokens"]
    # the loader holds out the last int(total * val_fraction) tokens: exactly the held-out documents
    val_fraction = (held + 0.5) / total
    return [f"data={json.dumps({'source': str(shards.resolve()), 'val_fraction': val_fraction})}"]


def data_kind(source: str) -> str:
    """ "copy" for a synthetic source (random tokens with copies, e.g. synthetic:copy_span), else "text"."""
    return "copy" if str(source).startswith(SYNTHETIC_PREFIX) else "text"


def held_out(cfg) -> tuple[Any, tuple[int, int]]:
    """(the held-out token stream: the tail the trainer validates on, or the first of `data.val_sets`
    where no tail is held out; the probes' token range). Synthetic data has none: (None, its symbols)."""
    source = cfg.data.source
    if data_kind(source) == "copy":
        task = get_task(source, seed=cfg.seed, **cfg.data.task_args)
        return None, (2, task.vocab_size)  # every id but <pad> and <eos>
    if source.startswith(TEXT_PREFIX):
        return TextLoader(cfg.data, "val", cfg.train.seq_len, 1).tokens, PRINTABLE
    shards = open_shards(source)
    vocab = (FIRST_PIECE, int(shards.manifest["vocab_size"]))
    val_sets = cfg.data.val_sets or {}
    if not cfg.data.val_fraction and val_sets:  # no tail held out: the first named validation set
        probe = open_shards(next(iter(val_sets.values())))
        return probe.read(0, probe.num_tokens), vocab
    total = shards.num_tokens
    n_val = int(total * cfg.data.val_fraction)  # as data_pipeline.loader holds it out
    return shards.read(total - n_val, total), vocab


def train_cell(recipe: str, overrides: list[str], run_dir: Path, log=print) -> None:
    """Train one run with the probe hook (resumes a partial run); marks it done."""
    cfg = load_recipe(recipe, overrides)
    tokens, token_range = held_out(cfg)
    t0 = time.time()
    probe = InductionProbe(tokens, token_range)
    res = ran_to_end(train(recipe, overrides, run_dir=run_dir, resume="auto", hooks=[probe]), run_dir.name)
    (run_dir / "study_done").write_text("ok\n")
    log(f"{run_dir.name}: step {res.final_step}, {time.time() - t0:.0f} s")


def read_run(run_dir: Path) -> dict[str, Any]:
    """{"variant", "layers", "seed", "rows": [metrics records that carry probe results]}."""
    cfg = read_config(run_dir)
    if cfg is None:
        raise StudyError(f"{run_dir} has no readable config.yaml. Fix: pass a run directory the trainer wrote")
    rows = read_metrics(run_dir)
    return {
        "name": run_dir.name,
        "variant": cfg["model"]["variant"],
        "layers": int(cfg["model"]["num_layers"]),
        "seed": int(cfg["seed"]),
        "kind": data_kind(cfg["data"]["source"]),
        "lr": float(cfg["optim"]["lr"]),
        "recipe": cfg["name"],
        "rows": [r for r in rows if "probe/induction_score" in r],
    }


def _row_key(key: str) -> bool:
    """What a data row keeps of an evaluation: the step, the losses and every scalar the probe wrote."""
    return (
        key in ("step", "tokens_seen", "val_loss")
        or key.startswith(("val_loss/", "probe/"))
        and not key.endswith("_heads")
    )


def study_row(run: dict[str, Any], command: str) -> dict[str, Any]:
    """One data row per run (docs/data/induction/runs.jsonl): what trained it and, per evaluation, the
    held-out losses and the probes' scalar scores (the per-head lists stay in the run's metrics)."""
    evals = [{k: v for k, v in r.items() if _row_key(k)} for r in run["rows"]]
    what = {k: run[k] for k in ("recipe", "variant", "layers", "seed", "lr", "kind")}
    return {"command": command, "run": run["name"], **what, "steps": evals[-1]["step"] if evals else 0, "evals": evals}


def run_of_row(row: dict[str, Any]) -> dict[str, Any]:
    """The `read_run` shape of a data row, so `summarize` and `table` render rows as they render runs."""
    return {
        **{k: row[k] for k in ("variant", "layers", "seed", "kind", "lr")},
        "name": row["run"],
        "rows": row["evals"],
    }


def by_cell(runs: list[dict[str, Any]]) -> list[tuple[tuple[str, int], list[dict[str, Any]]]]:
    """The runs of each (variant, layers), by layers and then the variants' order."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["variant"], r["layers"]), []).append(r)
    order = {v: i for i, v in enumerate(VARIANTS)}
    return sorted(cells.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 99)))


def curve_table(runs: list[dict[str, Any]], key: str, fmt: str = "{:.2f}") -> str:
    """`key` against step: one row per (variant, layers), mean ± std over seeds at each evaluated step
    every seed reached (at most 8 steps, evenly spaced, the last included)."""
    steps = sorted(set.intersection(*({e["step"] for e in r["rows"] if key in e} for r in runs)))
    steps = [steps[round(i * (len(steps) - 1) / 7)] for i in range(8)] if len(steps) > 8 else steps
    steps = sorted(set(steps))
    lines = ["| variant | layers | seeds | " + " | ".join(f"step {s}" for s in steps) + " |"]
    lines.append("|---|---:|---:|" + "---:|" * len(steps))
    for (variant, layers), rs in by_cell(runs):
        at = [Spread.of([next(e[key] for e in r["rows"] if e["step"] == s) for r in rs]).format(fmt) for s in steps]
        lines.append(f"| {variant} | {layers} | {len(rs)} | " + " | ".join(at) + " |")
    return "\n".join(lines)


def render_rows(rows: list[dict[str, Any]]) -> str:
    """Markdown from data rows: the final values per (variant, layers), then the induction score on
    repeated held-out text and the held-out loss against step."""
    runs = [run_of_row(r) for r in rows]
    if not runs:
        return "(no rows yet)\n"
    text = table(summarize(runs)) + "\n"
    if runs[0]["kind"] == "text":
        text += "\nInduction score on repeated held-out text (max head) against step:\n\n"
        text += curve_table(runs, "probe/induction_score_text", "{:.3f}") + "\n"
        text += "\nIn-context learning score (loss at token ~250 minus at ~25, nats) against step:\n\n"
        text += curve_table(runs, "probe/icl_score") + "\n"
        text += "\nHeld-out loss (nats/token) against step:\n\n" + curve_table(runs, "val_loss", "{:.3f}") + "\n"
    return text


def largest_drop(rows: list[dict[str, Any]], key: str) -> tuple[float, int]:
    """(the largest decrease of `key` between consecutive evaluations, the step it ends at)."""
    best, at = 0.0, 0
    for a, b in zip(rows, rows[1:]):
        if a[key] - b[key] > best:
            best, at = a[key] - b[key], b["step"]
    return best, at


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, layers): final values and the largest drop of the data's phase-change
    metric (the ICL score on text, the loss on repeated random tokens on copies), as Spreads over seeds."""
    out = []
    for (variant, layers), rs in by_cell([r for r in runs if r["rows"]]):
        kind = rs[0]["kind"]
        finals = [r["rows"][-1] for r in rs]
        drops = [largest_drop(r["rows"], DROP_KEY[kind]) for r in rs]
        row = {
            "variant": variant,
            "layers": layers,
            "kind": kind,
            "seeds": len(rs),
            "step": finals[0]["step"],
            "val_loss": Spread.of([f["val_loss"] for f in finals]),
            "drop": Spread.of([d for d, _ in drops]),
            "drop_steps": [s for _, s in drops],
            "source": finals[0].get("probe/source", ""),
        }
        for key in FINAL_KEYS[kind]:
            row[key] = Spread.of([f[f"probe/{key}"] for f in finals])
        if kind == "text":
            row["icl_first"] = Spread.of([r["rows"][0]["probe/icl_score"] for r in rs])
            row["repeat_text_gain"] = Spread.of(
                [f["probe/repeat_text_first_loss"] - f["probe/repeat_text_loss"] for f in finals]
            )
        out.append(row)
    return out


def _fixed(r: dict[str, Any]) -> str:
    return " (fixed map)" if r["source"] == "mixing_matrix" else ""


def _drop(r: dict[str, Any]) -> str:
    return f"{r['drop'].format()} ({', '.join(str(s) for s in r['drop_steps'])})"


# the table's columns per kind of data: (header, cell of a `summarize` row)
COLUMNS = {
    "copy": (
        ("held-out loss on the copy (nats/token)", lambda r: r["val_loss"].format()),
        ("induction score, repeated random tokens (max head)", lambda r: r["induction_score"].format() + _fixed(r)),
        ("previous-token score (max head)", lambda r: r["prev_token_score"].format() + _fixed(r)),
        ("repeated random tokens: acc on the repeat", lambda r: r["repeat_random_acc"].format("{:.1%}")),
        ("loss on the repeat", lambda r: r["repeat_random_loss"].format()),
        ("largest loss drop between evals (at step, per seed)", _drop),
    ),
    "text": (
        ("held-out loss (nats/token)", lambda r: r["val_loss"].format()),
        ("ICL score, first eval", lambda r: r["icl_first"].format()),
        ("ICL score, final", lambda r: r["icl_score"].format()),
        ("largest ICL drop between evals (at step, per seed)", _drop),
        ("induction score, repeated text (max head)", lambda r: r["induction_score_text"].format() + _fixed(r)),
        ("induction score, repeated random bytes", lambda r: r["induction_score"].format() + _fixed(r)),
        ("previous-token score, text", lambda r: r["prev_token_score_text"].format() + _fixed(r)),
        ("repeated text: acc on the repeat", lambda r: r["repeat_text_acc"].format("{:.1%}")),
        ("repeated text: loss gain of the repeat (nats)", lambda r: r["repeat_text_gain"].format()),
    ),
}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of `summarize`'s rows (all of one kind of data)."""
    columns = COLUMNS[rows[0]["kind"] if rows else "text"]
    header = ["variant", "layers", "seeds", "step", *(h for h, _ in columns)]
    return markdown_table(
        header, ([r["variant"], r["layers"], r["seeds"], r["step"], *(cell(r) for _, cell in columns)] for r in rows)
    )


def plot(runs: list[dict[str, Any]], path: Path) -> Path:
    """One panel per metric of the data's kind against step, one color per variant, solid 2 layers /
    dashed 3: one line per run (seed)."""
    kind = runs[0]["kind"]
    metrics = METRICS[kind]
    fig, axes = new_figure(2, 3, figsize=(15, 8))
    for ax in axes.flat[len(metrics) :]:
        ax.set_axis_off()
    color = {v: f"C{i}" for i, v in enumerate(DEFAULT_VARIANTS)}
    styles = {2: "-", 3: "--"}
    labelled = set()
    for r in sorted(runs, key=lambda r: (r["layers"], r["variant"], r["seed"])):
        if not r["rows"]:
            continue
        key = (r["variant"], r["layers"])
        for ax, (m, _) in zip(axes.flat, metrics):
            pts = [(x["step"], x[m]) for x in r["rows"] if x.get(m) is not None]
            ax.plot(
                *zip(*pts),
                styles.get(r["layers"], ":"),
                color=color.get(r["variant"], "k"),
                alpha=0.7,
                lw=1.2,
                label=f"{r['variant']} ({r['layers']} layers)" if key not in labelled else None,
            )
        labelled.add(key)
    for ax, (_, title) in zip(axes.flat, metrics):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[0][0].text(0.02, 0.02, "MixiT: its fixed map (no attention)", transform=axes[0][0].transAxes, fontsize=7)
    seeds = max(Counter((r["variant"], r["layers"]) for r in runs).values(), default=0)
    data = {
        "text": f"on {runs[0]['recipe']}'s text",
        "copy": "on random tokens with a span copied (synthetic:copy_span)",
    }[kind]
    layers = "-".join(str(n) for n in sorted({r["layers"] for r in runs}))
    fig.suptitle(
        f"{layers} layer models {data}, probes at every evaluation (one line per run; up to {seeds} seeds)", fontsize=11
    )
    return save_figure(fig, path)


def finished_runs(out: Path) -> list[dict[str, Any]]:
    runs_dir = out / "runs"
    dirs = sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []
    return [read_run(d) for d in dirs if (d / "study_done").is_file()]


def report(out: Path) -> tuple[str, Path]:
    runs = finished_runs(out)
    if not runs:
        raise StudyError(f"no finished runs under {out / 'runs'}. Fix: run the study without --report-only first")
    if len({r["kind"] for r in runs}) > 1:
        raise StudyError(
            f"{out / 'runs'} holds runs on text and on synthetic copies. Fix: give each kind of data its own --out"
        )
    rows = summarize(runs)
    text = table(rows)
    (out / "induction.md").write_text(text + "\n")
    plain = [{k: list(v.values) if isinstance(v, Spread) else v for k, v in r.items()} for r in rows]
    (out / "induction.json").write_text(json.dumps(plain, indent=1) + "\n")
    return text, plot(runs, out / "induction.png")


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.induction", __doc__)
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--out", default="outputs/induction")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--layers", type=positive_ints, default=[2], help="comma-separated layer counts (e.g. 2,3)")
    ap.add_argument(
        "--seeds", type=int, choices=range(1, 101), metavar="N", default=3, help="seeds per (variant, layers)"
    )
    ap.add_argument("--vocab-size", type=int, default=2048, help="BPE pieces (the tokenizer the study trains)")
    ap.add_argument("--bytes", action="store_true", help="train on the raw bytes instead of BPE tokens")
    ap.add_argument(
        "--repeat-fraction",
        type=float,
        default=0.0,
        help="BPE data: after this fraction of training paragraphs, add one that repeats its first "
        "--repeat-chars characters (bursty text; 0: WikiText as it is)",
    )
    ap.add_argument("--repeat-chars", type=int, default=400, help="length of the repeated chunk (characters)")
    ap.add_argument(
        "--repeat-style",
        choices=REPEAT_STYLES,
        default="prefix",
        help="prefix: the paragraph's first --repeat-chars characters twice, as one more document; span: a "
        "random run of its words written again at a random later point of the paragraph (varying distance); "
        "words: after the paragraph, a document of random words (by frequency) with such a repeated run",
    )
    ap.add_argument(
        "--repeat-epochs",
        type=int,
        default=1,
        help="span and words styles: the training text written this many times, with fresh random "
        "spans (and words) each time",
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny model for a few steps: the pipeline only")
    ap.add_argument("--report-only", action="store_true", help="train nothing; redraw the figure and table")
    ap.add_argument(
        "--rows",
        type=Path,
        help="also write one data row per finished run here (JSONL; replaces this command's rows, keeps others)",
    )
    ap.add_argument("overrides", nargs="*", help="recipe overrides section.key=value, applied to every run")
    a = ap.parse_args(argv)
    variants = names(a.variants)
    overrides = (SMOKE if a.smoke else []) + list(a.overrides)
    out = Path(a.out)

    def body() -> None:
        check_variants(variants)
        nonlocal overrides
        if not a.bytes and load_recipe(a.recipe, overrides).data.source.startswith(TEXT_PREFIX):
            repeats = (a.repeat_fraction, a.repeat_chars, a.repeat_style, a.repeat_epochs)
            overrides = prepare_bpe(a.recipe, overrides, out, a.vocab_size, *repeats) + overrides
        base_seed = load_recipe(a.recipe, overrides).seed
        cells = [(v, L, i) for L in a.layers for i in range(a.seeds) for v in variants]
        for v, L, i in cells:  # every run's recipe is checked before the first one trains
            load_recipe(a.recipe, overrides + cell_overrides(base_seed, v, L, i))
        t0 = time.time()
        if not a.report_only:
            for v, L, i in cells:
                run_dir = out / "runs" / run_name(v, L, i)
                if not (run_dir / "study_done").is_file():
                    train_cell(a.recipe, overrides + cell_overrides(base_seed, v, L, i), run_dir)
        text, png = report(out)
        if a.rows:
            # the command a row records is the one that re-measures it, whatever wrote the rows
            own = [x for x in without(sys.argv[1:] if argv is None else argv, "--rows") if x != "--report-only"]
            command = " ".join(["python -m studies.induction", *own])
            # re-running a study replaces its rows (same command and run) and keeps the others
            replace_rows(
                a.rows, [study_row(r, command) for r in finished_runs(out)], lambda r: (r["command"], r["run"])
            )
        print(text)
        print(f"plot: {png}   table: {out / 'induction.md'}   ({time.time() - t0:.0f} s)")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
