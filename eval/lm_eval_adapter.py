"""lm-evaluation-harness adapter: run `lm_eval` tasks on our checkpoints in-process.

`TrainablePartsLM(model, tokenizer)` implements loglikelihood (via TemplateLM's encoding and
`_loglikelihood_tokens`), loglikelihood_rolling and generate_until (greedy requests batched by
context length). It is registered as lm_eval model "trainable_parts" (model_args:
checkpoint=PATH[,tokenizer=DIR|bytes]; without a tokenizer, the checkpoint's own).

Slicing convention (the usual off-by-one): for context c (n tokens) and continuation y
(m tokens) the model reads inp = (c + y)[:-1] and the logits at positions
len(inp)-m .. len(inp)-1 predict y_1..y_m, i.e. logit row len(c)-1+j scores y_j.

Offline task configs live in eval/tasks/*.yaml with local JSONL data beside them (read by
eval/tasks/tp_data.py, so they run with no network and from any working directory, also under lm-eval's own
CLI: eval/lm_eval_cli.py). `exact_match:FILE.jsonl` (eval/exact_match.py)
runs as a generate_until task scored by the same rule as `eval.run`'s own exact_match task, so both
give the same numbers: generation runs to EOS or the longest record's budget (lm_eval's `until` is
one list per task, so it is left empty), then each record's own stop, or its answer's length,
decides the prediction.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
import yaml
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from data_pipeline.progress import progress_bar

from . import exact_match as em
from .generate import generate, is_greedy
from .loading import load_checkpoint, missing_tokenizer_error, pick_tokenizer
from .tasks import tp_data

TASK_DIR = Path(__file__).parent / "tasks"


@register_model("trainable_parts")
class TrainablePartsLM(TemplateLM):
    def __init__(
        self,
        model=None,
        tokenizer=None,
        checkpoint: str | None = None,
        batch_size: int | str | None = 8,
        device: str | None = None,
        max_length: int | None = None,
        info: dict[str, Any] | None = None,
        **_: Any,
    ):
        super().__init__()
        info = dict(info or {})
        if model is None:
            if checkpoint is None:
                raise ValueError("TrainablePartsLM needs model= or checkpoint=")
            if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
                device = "cpu"  # lm-eval's CLI asks for cuda:0 unless told otherwise
            model, info = load_checkpoint(checkpoint, device)
        tokenizer = pick_tokenizer(tokenizer, model, info)
        if tokenizer is None:
            raise missing_tokenizer_error(info, "lm_eval")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = max_length or model.cfg.max_seq_len
        self._device = next(model.parameters()).device

    # ---- TemplateLM hooks ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def device(self):
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        bar = progress_bar(
            total=len(requests), desc="loglikelihood", unit="request", enabled=not disable_tqdm, leave=False
        )
        for s in range(0, len(order), self.batch_size):
            idx = order[s : s + self.batch_size]
            conts = [list(requests[i][2]) for i in idx]
            if not all(conts):
                raise ValueError("empty continuation")
            inps = [(list(requests[i][1]) + cont)[:-1][-self.max_length :] for i, cont in zip(idx, conts)]
            x = torch.zeros(len(inps), max(map(len, inps)), dtype=torch.long, device=self._device)
            for r, inp in enumerate(inps):
                x[r, : len(inp)] = torch.tensor(inp)  # right padding: earlier positions are unaffected
            logp = F.log_softmax(self.model(x).float(), dim=-1)
            for r, i in enumerate(idx):
                n, m = len(inps[r]), len(conts[r])
                rows = logp[r, n - m : n]  # logit row n-m+j predicts cont[j]
                y = torch.tensor(conts[r], device=self._device)
                ll = float(rows.gather(-1, y[:, None]).double().sum())
                greedy = bool((rows.argmax(-1) == y).all())
                results[i] = (ll, greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], (ll, greedy))
            bar.update(len(idx))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in progress_bar(
            requests, desc="loglikelihood_rolling", unit="request", enabled=not disable_tqdm, leave=False
        ):
            (string,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            parts = self._loglikelihood_tokens([(None, c, y) for c, y in windows], disable_tqdm=True)
            ll = sum(p[0] for p in parts)
            out.append(ll)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until a stop string, EOS or max_gen_toks. Greedy requests with the
        same generation settings and context length run as one batch."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        plans = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", 32))
            do_sample = bool(gen_kwargs.pop("do_sample", False))
            temperature = float(gen_kwargs.pop("temperature", 1.0 if do_sample else 0.0))
            top_k, top_p = (gen_kwargs.get("top_k"), gen_kwargs.get("top_p")) if do_sample else (None, None)
            ctx = self.tok_encode(context) or [self.eot_token_id]
            ctx = ctx[-max(1, self.max_length - max_new) :]
            plans.append((ctx, until, max_new, top_k, top_p, temperature))
            greedy = not do_sample or is_greedy(top_k, top_p, temperature)
            key = (len(ctx), max_new) if greedy else ("sample", i)  # a sampled request runs alone
            groups.setdefault(key, []).append(i)
        bar = progress_bar(
            total=len(requests), desc="generate_until", unit="request", enabled=not disable_tqdm, leave=False
        )
        for key, idx in groups.items():
            for s in range(0, len(idx), self.batch_size):
                batch = idx[s : s + self.batch_size]
                _, _, max_new, top_k, top_p, temperature = plans[batch[0]]
                sampling = dict(top_k=top_k, top_p=top_p, temperature=temperature if key[0] == "sample" else 0.0)
                prompts = [plans[i][0] for i in batch]
                rows = generate(self.model, prompts, max_new, eos_id=self.eot_token_id, **sampling)
                for i, ids in zip(batch, rows):
                    text = em.continuation_text(self.tokenizer, plans[i][0], ids)
                    for stop in filter(None, plans[i][1]):  # cut at each stop string in turn
                        text = text.split(stop)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]


# ---- offline tasks -----------------------------------------------------------------------
def offline_tasks() -> list[str]:
    return sorted(p.stem for p in TASK_DIR.glob("*.yaml"))


class _TaskYaml(yaml.SafeLoader):
    """The bundled tasks' YAML: safe, with lm-eval's `!function tp_data.NAME` tag as the loader it names."""


def _task_function(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    return getattr(tp_data, loader.construct_scalar(node).removeprefix("tp_data."))


_TaskYaml.add_constructor("!function", _task_function)


def task_config(name: str) -> dict[str, Any]:
    """The shipped YAML config of an offline task, its data loader resolved (eval/tasks/tp_data.py)."""
    loader = _TaskYaml((TASK_DIR / f"{name}.yaml").read_text())  # a SafeLoader: no object is constructed
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def lm_eval_task_name(name: str) -> str:
    """The name lm_eval reports a task under: `exact_match_<stem>` for exact_match:FILE, else the name."""
    return "exact_match_" + em.task_file(name).stem if name.startswith(em.PREFIX) else name


def exact_match_task_config(path: str | Path, tokenizer) -> dict[str, Any]:
    """An lm_eval generate_until task over an exact-match file (eval/exact_match.py), scored by the
    same rule: each record's stop, or its answer's length, decides what is compared with the answer."""
    records = em.read_records(path)
    docs = [{"prompt": r.prompt, "answer": r.answer, "stops": list(r.stops), "line": r.line} for r in records]
    rec = {d["line"]: r for d, r in zip(docs, records)}

    def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
        r = rec[doc["line"]]
        ok, pos = em.score(em.prediction(results[0], r), r.answer)
        return {"exact_match": float(ok), "char_acc": sum(pos) / len(pos)}

    return {
        "task": lm_eval_task_name(em.PREFIX + str(path)),
        "custom_dataset": lambda **_: {"test": datasets.Dataset.from_list(docs)},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": lambda d: d["prompt"],
        "doc_to_target": lambda d: d["answer"],
        "target_delimiter": "",
        "generation_kwargs": {
            "until": [],
            "max_gen_toks": max(em.budget(tokenizer, r) for r in records),
            "do_sample": False,
        },
        "process_results": process_results,
        "metric_list": [
            {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True},
            {"metric": "char_acc", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }


def quiet_git_probe() -> None:
    """lm-eval records the git commit of the working directory with `git describe`, whose "fatal: not a git
    repository" reaches the terminal wherever lm-eval runs outside a checkout. The same probe, with git's
    own complaint kept off the terminal (lm-eval's answer unchanged: the commit, else the one its files name)."""
    import lm_eval.evaluator as evaluator  # deferred: heavy
    from lm_eval.loggers.utils import get_commit_from_path  # deferred: heavy

    def git_commit_hash() -> str | None:
        try:
            return subprocess.run(
                ["git", "describe", "--always"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    if hasattr(evaluator, "get_git_commit_hash"):
        evaluator.get_git_commit_hash = git_commit_hash


def run_lm_eval(
    lm: TrainablePartsLM, tasks: list[str], limit: int | float | None = None, num_fewshot: int | None = None
) -> dict[str, dict[str, float]]:
    """Run lm_eval tasks in-process; our offline tasks by name (eval/tasks), exact_match:FILE.jsonl,
    others as lm_eval names. Returns {task: {metric: value}} (numbers only)."""
    import lm_eval  # deferred: heavy
    from lm_eval.tasks import TaskManager  # deferred: heavy

    quiet_git_probe()
    ours = set(offline_tasks())
    specs: list[Any] = [
        task_config(t)
        if t in ours
        else exact_match_task_config(em.task_file(t), lm.tokenizer)
        if t.startswith(em.PREFIX)
        else t
        for t in tasks
    ]
    # Index lm_eval's built-in task library only when one of its tasks is asked for by name (it is slow).
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=any(isinstance(s, str) for s in specs))
    res = lm_eval.simple_evaluate(
        model=lm,
        tasks=specs,
        limit=limit,
        num_fewshot=num_fewshot,
        task_manager=manager,
        log_samples=False,
        bootstrap_iters=0,
        verbosity="WARNING",
    )
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        out[task] = {
            k.split(",")[0]: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not k.startswith("alias") and "stderr" not in k
        }
    return out
