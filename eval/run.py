"""Evaluate one checkpoint, or every checkpoint of one or more runs (incrementally).

    python -m eval.run --checkpoint PATH --tasks perplexity,induction,kv_recall --text val.txt \
        --tokenizer TOK --out results.json
    python -m eval.run --run-dir runs/std --run-dir runs/mixit --tasks induction,kv_recall --out-dir report/

Tasks: perplexity (needs --text FILE or --val-dir DIR; --val-dir NAME=DIR repeated: one result per
named set, e.g. per corpus source, and one pooled), induction, kv_recall, passkey (needs a
tokenizer), mechanisms, icl (Olsson et al.'s in-context learning score: loss late in a context minus
loss early, on --text FILE or --val-dir DIR, --n windows; eval/in_context.py),
classification (a classifier's accuracy and loss on its run's validation data),
synthetic:<task> (data_pipeline.synthetic, e.g. synthetic:kv_retrieval),
exact_match:FILE.jsonl (your own prompts and answers, greedy generation, exact match; eval/exact_match.py),
lm_eval:<task> (an offline config in eval/tasks, e.g. lm_eval:tp_kv_recall, lm_eval:exact_match:FILE.jsonl,
or any lm_eval task).
Without --tokenizer, the tokenizer the checkpoint was trained with is used (bytes, or the one its
recorded recipe names).
With --run-dir, results go to RUN/eval/results.jsonl (checkpoints already evaluated with the
same tasks and options are skipped), and the table (markdown + CSV), TensorBoard scalars and
per-metric PNG plots go to --out-dir. Under torchrun/deepspeed, perplexity and synthetic
batches are shared across ranks and rank 0 writes the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from checkpoint import run_checkpoints
from common.cli import CliParser, floats, ints, run_cli
from common.errors import EvalError, did_you_mean
from data_pipeline.progress import progress_bar

from . import distributed as D
from . import exact_match as em
from . import mechanisms, retrieval
from . import perplexity as ppl
from .classification import evaluate_classification
from .in_context import icl_score
from .lm_eval_adapter import TrainablePartsLM, lm_eval_task_name, run_lm_eval
from .loading import load_checkpoint, load_tokenizer, missing_tokenizer_error, pick_tokenizer
from .report import (
    checkpoint_table,
    flatten,
    plot_metrics,
    read_jsonl,
    rows_from_results,
    write_table,
    write_tensorboard,
)
from .synthetic_tasks import evaluate_task, get_task, task_to_score


@dataclass
class EvalOptions:
    tokenizer: Any = None  # dir, "bytes", a tokenizer object, or None: the checkpoint's own
    text: str | None = None  # perplexity on a text file
    val_dir: str | None = None  # perplexity on a prepared split (data_pipeline shards)
    val_sets: dict[str, str] = field(default_factory=dict)  # named prepared splits: one result each, and pooled
    window: int | None = None  # tokens per perplexity window (default: max_seq_len)
    stride: int | None = None  # default: window (no overlap)
    max_tokens: int | None = None
    batch_size: int = 8
    lengths: Sequence[int] = (16, 32, 64)  # induction
    num_pairs: Sequence[int] = (2, 4, 8)  # kv_recall
    passkey_lengths: Sequence[int] = (128, 256, 512)
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0)
    n: int = 32  # samples per length (probes)
    synthetic_n: int = 256
    task_args: dict | None = None  # synthetic:<task>: None -> the arguments the checkpoint trained with
    task_seed: int | None = None  # None -> the trained seed (DEFAULT_SEED for a checkpoint without one)
    other_task: bool = False  # allow task_args/task_seed that differ from the trained ones
    lm_eval_limit: int | float | None = None
    heatmap_dir: str | None = None
    seed: int = 0
    device: str = "cpu"
    progress: bool = True

    def signature(self, tasks: list[str] | None = None) -> str:
        """Hash of the options that change numbers (not device/progress/output paths), and of the
        contents of the tasks' own files (exact_match:FILE), so an edited file is evaluated again."""
        d = dataclasses.asdict(self)
        for k in ("device", "progress", "heatmap_dir"):
            d.pop(k)
        d["tokenizer"] = getattr(self.tokenizer, "identity", self.tokenizer)
        files = {
            t: em.file_digest(em.task_file(_exact_match_file_task(t))) for t in tasks or [] if _exact_match_file_task(t)
        }
        if files:
            d["task_files"] = files
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _exact_match_file_task(t: str) -> str | None:
    """`exact_match:FILE` for an exact-match task (ours or through lm_eval), else None."""
    file_task = t.removeprefix("lm_eval:")
    return file_task if file_task.startswith(em.PREFIX) else None


def result_key(t: str) -> str:
    """The key a task's results get: the task name, or [lm_eval:]exact_match:<file stem> for exact-match files."""
    file_task = _exact_match_file_task(t)
    return t if file_task is None else t.removesuffix(file_task) + em.result_key(file_task)


# ---- the tasks: name (or `prefix:`) -> how to run it ----------------------------------------------
# A runner takes (model, info, tokenizer, options, the task as written, progress) and returns its results.
Runner = Callable[[Any, dict[str, Any], Any, EvalOptions, str, bool], dict[str, Any]]


@dataclass(frozen=True)
class Task:
    run: Runner
    needs_tokenizer: Callable[[EvalOptions], bool] = lambda opts: False
    check: Callable[[str], None] = lambda task: None  # validates the task's argument before any work


def _token_stream(t: str, opts: EvalOptions, tok, info: dict[str, Any]):
    if opts.text:
        toks, nbytes = ppl.file_stream(opts.text, tok)
        return toks, nbytes, {"source": str(opts.text)}
    if opts.val_dir:
        toks, nbytes = ppl.shard_stream(opts.val_dir, tok, opts.max_tokens, info.get("tokenizer_id"))
        return toks, nbytes, {"source": str(opts.val_dir)}
    raise EvalError(f"task {t} needs --text FILE or --val-dir DIR (a prepared validation split)")


def _perplexity(model, info, tok, opts, t, prog):
    if opts.val_sets:
        return _perplexity_per_set(model, info, tok, opts, prog)
    toks, nbytes, src = _token_stream(t, opts, tok, info)
    if opts.max_tokens:
        toks = toks[: opts.max_tokens]
        nbytes = None if tok is None else len(tok.decode(list(toks[1:])).encode("utf-8"))
    return {**ppl.perplexity(model, toks, opts.window, opts.stride, opts.batch_size, nbytes, progress=prog), **src}


def _perplexity_per_set(model, info, tok, opts, prog):
    """Perplexity of each named set (as the trainer's `data.val_sets` report it), and pooled over their tokens."""
    out: dict[str, Any] = {}
    for name, directory in opts.val_sets.items():
        toks, nbytes = ppl.shard_stream(directory, tok, opts.max_tokens, info.get("tokenizer_id"))
        out[name] = {
            **ppl.perplexity(model, toks, opts.window, opts.stride, opts.batch_size, nbytes, progress=prog),
            "source": str(directory),
            "bytes": nbytes,
        }
    tokens = sum(r["tokens"] for r in out.values())
    nats = sum(r["loss"] * r["tokens"] for r in out.values())
    nbytes = [r["bytes"] for r in out.values()]
    pooled = {"loss": nats / tokens, "perplexity": math.exp(nats / tokens), "tokens": tokens}
    pooled["bits_per_byte"] = nats / math.log(2) / sum(nbytes) if all(nbytes) else None
    return {**out, "pooled": pooled}


def _icl(model, info, tok, opts, t, prog):
    toks, _, src = _token_stream(t, opts, tok, info)
    return {**icl_score(model, toks, opts.window, opts.n, batch_size=opts.batch_size), **src}


def _mechanisms(model, info, tok, opts, t, prog):
    hm = None
    if opts.heatmap_dir and D.is_main():
        hm = Path(opts.heatmap_dir) / f"mechanisms_{info.get('variant')}_step{info.get('step')}.png"
    return mechanisms.mechanism_scores(model, seed=opts.seed, heatmap=hm)


def _synthetic(model, info, tok, opts, t, prog):
    task, trained = task_to_score(t.split(":", 1)[1], info, opts.task_args, opts.task_seed, opts.other_task)
    res = evaluate_task(model, task, opts.synthetic_n, "test", max(opts.batch_size, 64), info=info, progress=prog)
    res["task_args"] = json.dumps({**task.args, "seed": task.seed}, sort_keys=True)  # a string: not a metric
    if trained is not None:
        res["trained_task_args"] = json.dumps(trained, sort_keys=True)
        print(
            f"warning: synthetic:{task.name} scored with {res['task_args']}; trained on {res['trained_task_args']}",
            file=sys.stderr,
        )
    return res


def _lm_eval(model, info, tok, opts, t, prog):
    lm = TrainablePartsLM(model, tok, batch_size=opts.batch_size, info=info)
    name = t.split(":", 1)[1]
    res = run_lm_eval(lm, [name], limit=opts.lm_eval_limit)
    return res.get(lm_eval_task_name(name), res)


def _check_exact_match_file(t: str) -> None:
    if _exact_match_file_task(t):
        em.read_records(em.task_file(_exact_match_file_task(t)))  # a missing or malformed file fails now


TASKS: dict[str, Task] = {
    "perplexity": Task(_perplexity, needs_tokenizer=lambda opts: bool(opts.text)),
    "icl": Task(_icl, needs_tokenizer=lambda opts: bool(opts.text)),
    "induction": Task(lambda m, i, tok, o, t, p: retrieval.induction(m, o.lengths, o.n, o.seed, tok, progress=p)),
    "kv_recall": Task(lambda m, i, tok, o, t, p: retrieval.kv_recall(m, o.num_pairs, o.n, o.seed, tok, progress=p)),
    "passkey": Task(
        lambda m, i, tok, o, t, p: retrieval.passkey(
            m, tok, o.passkey_lengths, o.depths, max(1, o.n // 8), o.seed, progress=p
        ),
        needs_tokenizer=lambda opts: True,
    ),
    "mechanisms": Task(_mechanisms),
    "classification": Task(
        lambda m, i, tok, o, t, p: evaluate_classification(m, i, o.task_args, max(o.batch_size, 64))
    ),
    "synthetic:": Task(_synthetic, check=lambda t: get_task(t.split(":", 1)[1])),  # raises for unknown names
    em.PREFIX: Task(
        lambda m, i, tok, o, t, p: em.evaluate_exact_match(m, tok, em.task_file(t), max(o.batch_size, 32), progress=p),
        needs_tokenizer=lambda opts: True,
        check=_check_exact_match_file,
    ),
    "lm_eval:": Task(_lm_eval, needs_tokenizer=lambda opts: True, check=_check_exact_match_file),
}
BASE_TASKS = tuple(k for k in TASKS if not k.endswith(":"))


def task_of(t: str) -> Task | None:
    """The registry entry of a task as written (a name, or a prefix with a non-empty argument)."""
    return TASKS.get(t) or next(
        (s for k, s in TASKS.items() if k.endswith(":") and t.startswith(k) and t[len(k) :]), None
    )


def validate_tasks(tasks: list[str] | str) -> list[str]:
    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    if not tasks:
        raise EvalError(
            f"no tasks given. Fix: choose from {list(BASE_TASKS)} or synthetic:<task>, "
            "exact_match:FILE.jsonl, lm_eval:<task>"
        )
    keys: dict[str, str] = {}
    for t in tasks:
        spec = task_of(t)
        if spec is None:
            hint = did_you_mean(t, BASE_TASKS)
            raise EvalError(
                f"unknown task {t!r}. {hint}Fix: use one of {list(BASE_TASKS)}, synthetic:<task> "
                "(e.g. synthetic:kv_retrieval), exact_match:FILE.jsonl, lm_eval:<task> "
                "(e.g. lm_eval:tp_kv_recall)"
            )
        spec.check(t)
        if result_key(t) in keys:
            raise EvalError(
                f"tasks {keys[result_key(t)]!r} and {t!r} would both report as {result_key(t)!r}. "
                "Fix: list each task once, and give exact_match files different names"
            )
        keys[result_key(t)] = t
    return list(tasks)


def evaluate_model(
    model, info: dict[str, Any], tasks: list[str] | str, opts: EvalOptions | None = None
) -> dict[str, Any]:
    """Run `tasks` on an already-loaded model; returns {"checkpoint": info, "tasks": {...}, "metrics": {...}}."""
    opts = opts or EvalOptions()
    tasks = validate_tasks(tasks)
    tok = pick_tokenizer(opts.tokenizer, model, info)
    needs = [t for t in tasks if task_of(t).needs_tokenizer(opts)]
    if tok is None and needs:
        raise missing_tokenizer_error(info, f"task {needs[0]}")
    prog = opts.progress and D.is_main()
    t0 = time.time()
    out = {result_key(t): task_of(t).run(model, info, tok, opts, t, prog) for t in tasks}
    ck = {k: info.get(k) for k in ("path", "step", "tokens_seen", "variant", "tokenizer_id")}
    ck["tokenizer_used"] = getattr(tok, "identity", None)
    return {
        "checkpoint": ck,
        "tasks": out,
        "metrics": flatten(out),
        "options_signature": opts.signature(tasks),
        "seconds": round(time.time() - t0, 3),
    }


def evaluate_checkpoint(
    path: str | Path, tasks: list[str] | str, opts: EvalOptions | None = None, **kw: Any
) -> dict[str, Any]:
    """Load any checkpoint (native, HF, DeepSpeed tag, run dir) and evaluate `tasks` on it.
    Keyword arguments override EvalOptions fields."""
    opts = dataclasses.replace(opts or EvalOptions(), **kw)
    validate_tasks(tasks)
    model, info = load_checkpoint(path, opts.device)
    return evaluate_model(model, info, tasks, opts)


def evaluate_run(run_dir: str | Path, tasks: list[str] | str, opts: EvalOptions | None = None) -> list[dict[str, Any]]:
    """Evaluate every complete checkpoint of a run not yet in RUN/eval/results.jsonl (same tasks+options)."""
    opts = opts or EvalOptions()
    tasks = validate_tasks(tasks)
    run_dir = Path(run_dir)
    results_path = run_dir / "eval" / "results.jsonl"
    if not run_dir.is_dir():
        raise EvalError(f"run dir {run_dir} does not exist")
    ckpts = run_checkpoints(run_dir)
    if not ckpts:
        raise EvalError(f"run dir {run_dir} has no complete checkpoints (looked in {run_dir / 'checkpoints'})")
    key = (opts.signature(tasks), tuple(tasks))

    def same_setup(r: dict[str, Any]) -> bool:
        return (r.get("options_signature"), tuple(r.get("task_list", []))) == key

    have = read_jsonl(results_path)
    done = {r["checkpoint"]["step"] for r in have if same_setup(r)}
    todo = [(s, p) for s, p in ckpts if s not in done]
    for step, path in progress_bar(
        todo, desc=f"checkpoints of {run_dir.name}", unit="checkpoint", enabled=opts.progress and D.is_main()
    ):
        model, info = load_checkpoint(path, opts.device)
        if info.get("step") is None:
            info["step"] = step
        res = evaluate_model(model, info, tasks, opts)
        res["run"] = run_dir.name
        res["task_list"] = list(tasks)
        if D.is_main():
            results_path.parent.mkdir(parents=True, exist_ok=True)
            with open(results_path, "a") as f:
                f.write(json.dumps(res) + "\n")
        have.append(res)
    return sorted(filter(same_setup, have), key=lambda r: r["checkpoint"]["step"])


def write_reports(results_by_run: dict[str, list[dict[str, Any]]], out_dir: str | Path) -> dict[str, Any]:
    """results.md / results.csv, TensorBoard (out_dir/tb/<run>), plots (out_dir/plots/*.png)."""
    out_dir = Path(out_dir)
    rows = [r for run, res in results_by_run.items() for r in rows_from_results(res, run)]
    write_table(rows, out_dir / "results.md", out_dir / "results.csv")
    for run, res in results_by_run.items():
        write_tensorboard(rows_from_results(res, run), out_dir / "tb" / run)
    plots = plot_metrics(rows, out_dir / "plots")
    return {
        "table": str(out_dir / "results.md"),
        "csv": str(out_dir / "results.csv"),
        "tensorboard": str(out_dir / "tb"),
        "plots": [str(p) for p in plots],
    }


def parse_val_dirs(entries: list[str]) -> tuple[str | None, dict[str, str]]:
    """`--val-dir DIR` (one split) or `--val-dir NAME=DIR ...` (named sets) -> (DIR, {}) or (None, sets)."""
    if not entries:
        return None, {}
    named = [e.partition("=") for e in entries]
    if len(entries) == 1 and not named[0][1]:
        return entries[0], {}
    bad = [e for e, (name, eq, d) in zip(entries, named) if not (eq and name and d)]
    if bad or len({n for n, _, _ in named}) < len(named):
        raise EvalError(
            f"--val-dir {entries}: several sets must each be NAME=DIR with distinct names. "
            "Fix: e.g. --val-dir linux-doc=data/valid-linux-doc --val-dir gcide=data/valid-gcide"
        )
    return None, {name: d for name, _, d in named}


def build_parser() -> argparse.ArgumentParser:
    ap = CliParser(
        prog="python -m eval.run",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="native / HF / DeepSpeed checkpoint dir (or a run dir: its latest)")
    src.add_argument("--run-dir", action="append", help="evaluate every checkpoint of this run (repeatable)")
    ap.add_argument("--tasks", required=True, help="comma-separated task names")
    ap.add_argument("--out", help="results JSON (--checkpoint mode)")
    ap.add_argument("--out-dir", help="table/plots/TensorBoard dir (--run-dir mode; default RUN/eval)")
    ap.add_argument(
        "--tokenizer",
        help="tokenizer dir, or 'bytes' for the byte tokenizer (default: the one the checkpoint was trained with)",
    )
    ap.add_argument("--text", help="perplexity: a UTF-8 text file")
    ap.add_argument(
        "--val-dir",
        action="append",
        help="perplexity: a prepared split directory (manifest.json + shards), or NAME=DIR repeated: "
        "one result per named set and one pooled over their tokens",
    )
    ap.add_argument("--window", type=int)
    ap.add_argument("--stride", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lengths", type=ints, default=(16, 32, 64), help="induction lengths")
    ap.add_argument("--num-pairs", type=ints, default=(2, 4, 8), help="kv_recall pair counts")
    ap.add_argument("--passkey-lengths", type=ints, default=(128, 256, 512))
    ap.add_argument("--depths", type=floats, default=(0.0, 0.25, 0.5, 0.75, 1.0))
    ap.add_argument("--n", type=int, default=32, help="samples per length for the probes")
    ap.add_argument("--synthetic-n", type=int, default=256)
    ap.add_argument(
        "--task-args",
        type=json.loads,
        help="synthetic tasks: JSON, e.g. '{\"n_pairs\": 4}' (default: the arguments the checkpoint trained with)",
    )
    ap.add_argument("--task-seed", type=int, help="synthetic tasks: the task's seed (default: the trained one)")
    ap.add_argument(
        "--other-task",
        action="store_true",
        help="score a synthetic task with --task-args/--task-seed that differ from the trained ones (printed in the results)",
    )
    ap.add_argument("--lm-eval-limit", type=float)
    ap.add_argument("--heatmap-dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def run(a: argparse.Namespace) -> int:
    D.init_from_env()
    tasks = validate_tasks(a.tasks)
    val_dir, val_sets = parse_val_dirs(a.val_dir or [])
    limit = a.lm_eval_limit
    flags = {f.name: getattr(a, f.name) for f in dataclasses.fields(EvalOptions) if hasattr(a, f.name)}
    opts = EvalOptions(
        **{
            **flags,  # the options a flag of the same name gives as is; the rest:
            "tokenizer": load_tokenizer(a.tokenizer),
            "val_dir": val_dir,
            "val_sets": val_sets,
            "lm_eval_limit": int(limit) if limit is not None and limit >= 1 else limit,
            "device": a.device or ("cuda" if torch.cuda.is_available() else "cpu"),
            "progress": not a.no_progress,
        }
    )
    if a.checkpoint:
        res = evaluate_checkpoint(a.checkpoint, tasks, opts)
        if D.is_main():
            text = json.dumps(res, indent=2)
            if a.out:  # the headline numbers here, every number in the file
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(text + "\n")
                print(checkpoint_table(res))
                print(f"wrote {a.out}", file=sys.stderr)
            else:
                print(text)
        return 0
    by_run = {}
    for rd in a.run_dir:
        name = Path(rd).resolve().name
        if name in by_run:
            name = str(Path(rd).resolve())
        by_run[name] = evaluate_run(rd, tasks, opts)
    if D.is_main():
        out_dir = a.out_dir or str(Path(a.run_dir[0]) / "eval")
        rep = write_reports(by_run, out_dir)
        if a.out:
            Path(a.out).write_text(json.dumps(by_run, indent=2) + "\n")
        print(Path(rep["table"]).read_text(), end="")  # the headline numbers; every number in the CSV
        print(
            f"wrote {rep['table']}, {rep['csv']}, {rep['tensorboard']} and {len(rep['plots'])} plots", file=sys.stderr
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
