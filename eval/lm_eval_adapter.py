"""lm-evaluation-harness adapter: run `lm_eval` tasks on our checkpoints in-process.

`TrainablePartsLM(model, tokenizer)` implements loglikelihood (via TemplateLM's encoding and
`_loglikelihood_tokens`), loglikelihood_rolling and generate_until. It is registered as
lm_eval model "trainable_parts" (model_args: checkpoint=PATH,tokenizer=DIR|bytes).

Slicing convention (the usual off-by-one): for context c (n tokens) and continuation y
(m tokens) the model reads inp = (c + y)[:-1] and the logits at positions
len(inp)-m .. len(inp)-1 predict y_1..y_m, i.e. logit row len(c)-1+j scores y_j.

Offline task configs live in eval/tasks/*.yaml with local JSONL data; `run_lm_eval`
resolves their data paths, so they run with no network.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from .generate import generate
from .loading import check_tokenizer, load_checkpoint, load_tokenizer

TASK_DIR = Path(__file__).parent / "tasks"


@register_model("trainable_parts")
class TrainablePartsLM(TemplateLM):
    def __init__(self, model=None, tokenizer=None, checkpoint: str | None = None, batch_size: int | str | None = 8,
                 device: str | None = None, max_length: int | None = None, **_: Any):
        super().__init__()
        info: dict[str, Any] = {}
        if model is None:
            if checkpoint is None:
                raise ValueError("TrainablePartsLM needs model= or checkpoint=")
            model, info = load_checkpoint(checkpoint, device or "cpu")
        tokenizer = load_tokenizer(tokenizer)
        if tokenizer is None:
            raise ValueError("TrainablePartsLM needs a tokenizer (tokenizer=DIR or tokenizer=bytes)")
        check_tokenizer(tokenizer, model, info)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.info = info
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
        bar = tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm, leave=False)
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            inps, conts = [], []
            for i in idx:
                _, ctx, cont = requests[i]
                if not cont:
                    raise ValueError("empty continuation")
                inp = (list(ctx) + list(cont))[:-1][-self.max_length:]
                inps.append(inp)
                conts.append(list(cont))
            width = max(len(x) for x in inps)
            x = torch.zeros(len(inps), width, dtype=torch.long, device=self._device)
            for r, inp in enumerate(inps):
                x[r, :len(inp)] = torch.tensor(inp)      # right padding: earlier positions are unaffected
            logp = F.log_softmax(self.model(x).float(), dim=-1)
            for r, i in enumerate(idx):
                n, m = len(inps[r]), len(conts[r])
                rows = logp[r, n - m:n]                       # logit row n-m+j predicts cont[j]
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
        for req in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm, leave=False):
            (string,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            parts = self._loglikelihood_tokens([(None, c, y) for c, y in windows], disable_tqdm=True)
            ll = sum(p[0] for p in parts)
            out.append(ll)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in tqdm(requests, desc="generate_until", disable=disable_tqdm, leave=False):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            max_new = int(gen_kwargs.pop("max_gen_toks", 32))
            do_sample = bool(gen_kwargs.pop("do_sample", False))
            temperature = float(gen_kwargs.pop("temperature", 0.0 if not do_sample else 1.0))
            ctx = self.tok_encode(context) or [self.eot_token_id]
            ctx = ctx[-max(1, self.max_length - max_new):]
            ids = generate(self.model, ctx, max_new, eos_id=self.eot_token_id,
                           top_k=gen_kwargs.get("top_k") if do_sample else None,
                           top_p=gen_kwargs.get("top_p") if do_sample else None,
                           temperature=temperature if do_sample else 0.0)
            if ids and ids[-1] == self.eot_token_id:
                ids = ids[:-1]
            text = self.tok_decode(ids)
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        return out


# ---- offline tasks -----------------------------------------------------------------------
def offline_tasks() -> list[str]:
    return sorted(p.stem for p in TASK_DIR.glob("*.yaml"))


def task_config(name: str) -> dict[str, Any]:
    """The shipped YAML config of an offline task, with its data paths made absolute."""
    path = TASK_DIR / f"{name}.yaml"
    cfg = yaml.safe_load(path.read_text())
    files = cfg.get("dataset_kwargs", {}).get("data_files")
    if isinstance(files, dict):
        cfg["dataset_kwargs"]["data_files"] = {k: str((TASK_DIR / v).resolve()) for k, v in files.items()}
    return cfg


def run_lm_eval(lm: TrainablePartsLM, tasks: list[str], limit: int | float | None = None,
                num_fewshot: int | None = None) -> dict[str, dict[str, float]]:
    """Run lm_eval tasks in-process; our offline tasks by name (eval/tasks), others as lm_eval names.
    Returns {task: {metric: value}} (numbers only)."""
    import lm_eval  # deferred: heavy
    from lm_eval.tasks import TaskManager  # deferred: heavy
    ours = set(offline_tasks())
    specs: list[Any] = [task_config(t) if t in ours else t for t in tasks]
    # Index lm_eval's built-in task library only when a non-local task is asked for (it is slow).
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=not all(t in ours for t in tasks))
    res = lm_eval.simple_evaluate(model=lm, tasks=specs, limit=limit, num_fewshot=num_fewshot, task_manager=manager,
                                  log_samples=False, bootstrap_iters=0, verbosity="WARNING")
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        out[task] = {k.split(",")[0]: float(v) for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not k.startswith("alias") and "stderr" not in k}
    return out
