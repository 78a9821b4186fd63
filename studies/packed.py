"""MixiT on packed text: does its arithmetic survive windows that are not aligned to examples?

    python -m studies.packed --out outputs/packed --seeds 3
    python -m studies.packed --out outputs/packed_T63 --layouts aligned --model-len 63   # aligned, 63-position model
    python -m studies.packed --smoke --out /tmp/packed                 # seconds: the pipeline only

MixiT mixes tokens by a fixed matrix indexed by ABSOLUTE position, and the demo's arithmetic puts
one example per sequence at position 0; LM pretraining instead packs documents into windows at
arbitrary offsets. This study writes the demo's modular-addition examples (p = 31, the same 95/5
split of pairs as `synthetic:modular_addition`) as text, one example per line, each number one byte
(chr(65 + n)): "a b c\\n" is 4 bytes. It trains `standard`, `frozen_qk` and `mixit`
(recipes/packed_modadd.yaml: the demo's model and optimizer, same examples per step) through the
trainer's `text:` reader in four layouts (LAYOUTS; docs/results/packed.md):

- `aligned`:  one example per 4-token window, at position 0 (the synthetic task's layout, as bytes);
- `packed`:   the byte stream cut into windows of 63 tokens, examples at every offset;
- `docpack`:  64-token windows of 16 whole examples, at positions 0, 4, 8, ...;
- `reset`:    `packed`'s windows with attention masked to each example and positions (MixiT's mixing
              too) restarting at it, so every example is trained as if alone at position 0.

Every model is then scored on the 48 held-out pairs, each placed after `o` bytes of its own layout's
training text for every offset o its context allows: the accuracy of c, predicted at b's position.
Reported per (layout, variant): accuracy at offset 0, the mean over every offset and over offsets 4k;
OUT/packed.png plots accuracy against offset. Seed i trains with the recipe's seed + i and MixiT
matrices of seed i; re-running skips finished runs.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from checkpoint import load_for_eval
from common.cli import run_cli
from common.errors import StudyError
from data_pipeline.synthetic import get_task
from data_pipeline.text import eos_document_ids
from data_pipeline.tokenizer import BYTE_TOKENIZER
from eval.report import markdown_table, new_figure, save_figure
from pretrain.config import load_recipe
from pretrain.train import train

from .shared import check_variants, label_axes, names, ran_to_end, seed_overrides, study_parser
from .spread import Spread

RECIPE = "recipes/packed_modadd.yaml"
DEFAULT_VARIANTS = ("standard", "frozen_qk", "mixit")
P = 31  # the demo's modulus
BASE = 65  # number n is the byte chr(65 + n): 'A' .. '_' for p = 31
# layout -> recipe overrides (the data file and val_fraction are added per run)
LAYOUTS = {
    "aligned": {"seq_len": 4, "data": {"documents": "lines", "windows": "documents"}, "batch": 64},
    "packed": {"seq_len": 63, "data": {}, "batch": 4},
    "docpack": {"seq_len": 64, "data": {"documents": "lines", "windows": "documents"}, "batch": 4},
    "reset": {"seq_len": 63, "data": {"documents": "lines", "return_doc_ids": True}, "batch": 4},
}
SMOKE = [
    "train.max_steps=4",
    "train.eval_every_steps=0",
    "checkpoint.every_steps=0",
    "model.hidden_size=32",
    "model.intermediate_size=64",
]


def encode(a: int, b: int, c: int) -> bytes:
    return bytes([BASE + a, BASE + b, BASE + c])


def write_data(path: Path, p: int, seed: int, repeats: int, val_repeats: int) -> dict[str, Any]:
    """One example per line: `repeats` shuffled passes over the training pairs, then `val_repeats` over the
    held-out pairs (the file's tail, which val_fraction selects). Returns the split sizes."""
    task = get_task("modular_addition", seed=seed, p=p)
    train_pairs = [task.pair(i, "train") for i in range(task.size("train"))]
    test_pairs = [task.pair(i, "test") for i in range(task.size("test"))]
    rng = random.Random(seed)
    lines = []
    for pairs, reps in ((train_pairs, repeats), (test_pairs, val_repeats)):
        for _ in range(reps):
            order = list(pairs)
            rng.shuffle(order)
            lines += [encode(a, b, (a + b) % p) for a, b in order]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    n_val = len(test_pairs) * val_repeats
    return {
        "train_pairs": train_pairs,
        "test_pairs": test_pairs,
        "lines": len(lines),
        "val_lines": n_val,
        # the tail held out exactly (bytes and lines alike: every line is 4 bytes), whatever the rounding
        "val_fraction": (n_val + 0.5) / len(lines),
    }


def layout_overrides(layout: str, data_file: Path, val_fraction: float, model_len: int | None = None) -> list[str]:
    """The layout's data and window; the model's context is the window unless `model_len` is given."""
    spec = LAYOUTS[layout]
    data = {"source": f"text:{data_file}", "val_fraction": val_fraction, **spec["data"]}
    return [
        f"data={json.dumps(data)}",
        f"train.seq_len={spec['seq_len']}",
        f"model.max_seq_len={model_len or spec['seq_len']}",
        f"train.global_batch_sequences={spec['batch']}",
        f"train.micro_batch_sequences={spec['batch']}",
    ]


def context_stream(layout: str, train_pairs, p: int, seed: int, n: int = 4096) -> list[int]:
    """Training text in `layout`'s byte form (newline or EOS after each 3-byte example) to draw contexts from."""
    rng = random.Random(f"context-{seed}")
    sep = [10] if layout == "packed" else [BYTE_TOKENIZER.eos_id]
    out: list[int] = []
    while len(out) < n:
        a, b = rng.choice(train_pairs)
        out += list(encode(a, b, (a + b) % p)) + sep
    return out


@torch.no_grad()
def accuracy_by_offset(model, layout: str, test_pairs, train_pairs, p: int, seed: int = 0) -> dict[int, float]:
    """{offset o: accuracy of c over the held-out pairs, each after o bytes of training text}. The
    context starts at an example boundary when o is a multiple of 4 (whole examples before it, as in
    `docpack` windows), anywhere otherwise. `aligned` models (4-token context) are scored at o = 0."""
    T = model.cfg.max_seq_len
    resets = bool(LAYOUTS[layout]["data"].get("return_doc_ids"))  # score as trained: one document per example
    stream = context_stream(layout, train_pairs, p, seed)
    rng = random.Random(f"offsets-{seed}")
    out = {}
    offsets = [0] if layout == "aligned" else range(0, T - 1)  # a and b must fit: o + 2 <= T
    for o in offsets:
        xs, ys = [], []
        for a, b in test_pairs:
            start = 4 * rng.randrange((len(stream) - o) // 4) if o % 4 == 0 else rng.randrange(len(stream) - o)
            ctx = stream[start : start + o]
            xs.append(ctx + [BASE + a, BASE + b])
            ys.append(BASE + (a + b) % p)
        x = torch.tensor(xs)
        logits = model(x, doc_ids=document_ids(x) if resets else None)[:, -1]
        out[o] = float((logits.argmax(-1) == torch.tensor(ys)).float().mean())
    return out


def document_ids(x: torch.Tensor) -> torch.Tensor:
    """Per-position document index of contexts built by `accuracy_by_offset` for a `reset` model: a
    document ends with its EOS (as the text reader writes them) and the scored example, its last two
    tokens, is a document of its own (the reader would have ended the one before it)."""
    ids = torch.from_numpy(eos_document_ids(x.numpy()))
    ids[:, -2:] = ids[:, -3:-2] + 1 if x.shape[1] > 2 else 0
    return ids


def summarize_offsets(acc: dict[int, float]) -> dict[str, float | None]:
    """Accuracy at offset 0, over every offset and over offsets 0, 4, 8, ... (None: only offset 0 was scored)."""
    if len(acc) == 1:
        return {"offset0": acc[0], "all_offsets": None, "slots_4k": None}
    return {
        "offset0": acc[0],
        "all_offsets": sum(acc.values()) / len(acc),
        "slots_4k": sum(v for o, v in acc.items() if o % 4 == 0) / len([o for o in acc if o % 4 == 0]),
    }


def run_cell(
    recipe: str, overrides: list[str], run_dir: Path, layout: str, data: dict[str, Any], p: int, seed: int
) -> dict[str, Any]:
    t0 = time.time()
    res = ran_to_end(train(recipe, overrides, run_dir=run_dir, resume="auto"), run_dir.name)
    model, _ = load_for_eval(res.last_checkpoint)
    model.eval()
    acc = accuracy_by_offset(model, layout, data["test_pairs"], data["train_pairs"], p, seed)
    return {
        "layout": layout,
        "by_offset": {str(k): v for k, v in acc.items()},
        **summarize_offsets(acc),
        "final_loss": res.losses[max(res.losses)] if res.losses else None,
        "steps": res.final_step,
        "seconds": round(time.time() - t0, 1),
    }


def table(results: dict[tuple[str, str], list[dict[str, Any]]], variants, layouts) -> str:
    header = ["layout", "variant", "seeds", "acc, example alone at position 0", "acc, mean over every offset"]
    rows = []
    for layout in layouts:
        for v in variants:
            rs = results.get((layout, v), [])
            if not rs:
                continue
            cells = [
                Spread.of([r[k] for r in rs]).format("{:.1%}") if rs[0][k] is not None else "— (4-token context)"
                for k in ("offset0", "all_offsets", "slots_4k")
            ]
            rows.append([layout, v, len(rs), *cells])
    return markdown_table([*header, "acc, mean over offsets 0, 4, 8, ..."], rows)


def plot(results: dict[tuple[str, str], list[dict[str, Any]]], variants, layouts, path: Path) -> Path:
    fig, axes = new_figure(1, len(layouts), figsize=(5 * len(layouts), 3.8), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        for i, v in enumerate(variants):
            for j, r in enumerate(results.get((layout, v), [])):
                pts = sorted((int(o), a) for o, a in r["by_offset"].items())
                xs, ys = zip(*pts)
                ax.plot(
                    xs, ys, "o-" if len(xs) == 1 else "-", color=f"C{i}", alpha=0.7, ms=5, label=v if j == 0 else None
                )
        ax.axhline(1 / 31, color="gray", ls=":", lw=1)
        ax.set_ylim(-0.02, 1.02)
        xlabel = "offset of the held-out example in its window (bytes)"
        label_axes(ax, xlabel, "accuracy of c", f"trained: {layout}", grid=False)
    fig.suptitle(
        "modular addition (p = 31) as bytes: held-out accuracy vs where the example sits (dotted: chance)", fontsize=10
    )
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = study_parser("studies.packed", __doc__)
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--out", default="outputs/packed")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--seeds", type=int, choices=range(1, 101), metavar="N", default=3)
    ap.add_argument(
        "--model-len",
        type=int,
        metavar="T",
        help="the model's max_seq_len for every layout (default: the layout's window). MixiT's matrix "
        "depends on it: its random part has std ~ 1/sqrt(T)",
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny model for a few steps: the pipeline only")
    ap.add_argument("overrides", nargs="*", help="recipe overrides section.key=value, applied to every run")
    a = ap.parse_args(argv)
    variants, layouts = names(a.variants), names(a.layouts)
    overrides = (SMOKE if a.smoke else []) + list(a.overrides)
    out = Path(a.out)

    def body() -> None:
        check_variants(variants)
        for x in layouts:
            if x not in LAYOUTS:
                raise StudyError(f"unknown layout {x!r}. Fix: choose from {list(LAYOUTS)}")
        window = max(LAYOUTS[x]["seq_len"] for x in layouts)
        if a.model_len is not None and a.model_len < window:
            raise StudyError(f"--model-len {a.model_len} is shorter than a window ({window}). Fix: use >= {window}")
        t0 = time.time()
        base = load_recipe(a.recipe, overrides)
        repeats = 2 if a.smoke else 200
        files = {i: out / "data" / f"modadd_p{P}_seed{base.seed + i}.txt" for i in range(a.seeds)}
        datas = {i: write_data(f, P, base.seed + i, repeats=repeats, val_repeats=repeats) for i, f in files.items()}
        cells = {}
        for i in range(a.seeds):
            for x in layouts:
                for v in variants:
                    cell = layout_overrides(x, files[i].resolve(), datas[i]["val_fraction"], a.model_len)
                    cell += [f"model.variant={v}", *seed_overrides(base.seed, i)]
                    load_recipe(a.recipe, overrides + cell)  # every run's recipe is checked before the first trains
                    cells[(x, v, i)] = overrides + cell
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for (x, v, i), over in cells.items():
            run_dir = out / "runs" / (f"{x}-{v}-s{i}" + (f"-T{a.model_len}" if a.model_len else ""))
            done = run_dir / "study_result.json"
            if done.is_file():
                r = json.loads(done.read_text())
            else:
                r = run_cell(a.recipe, over, run_dir, x, datas[i], P, base.seed + i)
                done.write_text(json.dumps(r) + "\n")
                every = "" if r["all_offsets"] is None else f", every offset {r['all_offsets']:.1%}"
                print(f"{x}/{v}/seed {i}: offset 0 {r['offset0']:.1%}{every} ({r['seconds']} s)", flush=True)
            results.setdefault((x, v), []).append(r)
        text = table(results, variants, layouts)
        (out / "packed.md").write_text(text + "\n")
        (out / "packed.json").write_text(json.dumps({f"{x}/{v}": rs for (x, v), rs in results.items()}, indent=1))
        png = plot(results, variants, layouts, out / "packed.png")
        print(text)
        print(f"plot: {png}   table: {out / 'packed.md'}   ({time.time() - t0:.0f} s)")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
