"""lm-eval's own command line, with this project's models and tasks registered first.

    python -m eval.lm_eval_cli --model hf --model_args pretrained=EXPORT --tasks tp_kv_recall,tp_text [--limit 10]
    python -m eval.lm_eval_cli --model trainable_parts --model_args checkpoint=RUN_OR_EXPORT --tasks tp_passkey

Every argument is lm-eval's (its parser, its evaluator, its output); this module only does, before handing
over, what lm-eval cannot: `import model.hf` registers TrainablePartsForCausalLM (the class of MixiT, shaped,
µP and bidirectional exports) with transformers' Auto classes, so lm-eval's `hf` model loads those exports
with no remote code; importing eval.lm_eval_adapter registers lm-eval model `trainable_parts` (any checkpoint
of ours, with its own tokenizer or `tokenizer=bytes`); and `--include_path eval/tasks` (the bundled offline
tasks, whose data is found beside their YAML from any working directory) is added unless one is given; and
lm-eval's probe of the working directory's git commit runs without git's "fatal: not a git repository"
outside a checkout.
A local `hf` directory is checked first (one with no tokenizer is refused in one line) and, where it holds
our class, gets `backend=causal` in --model_args.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lm_eval.models  # noqa: F401  (lm-eval's own models: registering ours first would hide them, lm-eval 0.4.13)
from lm_eval.__main__ import cli_evaluate

from common.cli import run_cli
from common.errors import EvalError
from model.hf import MODEL_TYPE  # the import registers TrainablePartsForCausalLM with the Auto classes

from .lm_eval_adapter import TASK_DIR, quiet_git_probe  # the import registers lm-eval model `trainable_parts`

HF_MODELS = ("hf", "hf-auto", "huggingface")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
MODEL_ARGS = ("--model_args", "-a")


def _span(argv: list[str], *names: str) -> tuple[int, int, list[str]] | None:
    """Where an option stands (`--x a b` or `--x=a`): its index, the index after its values, and the values."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg.startswith(name + "="):
                return i, i + 1, [arg.split("=", 1)[1]]
            if arg == name:
                end = i + 1
                while end < len(argv) and not argv[end].startswith("-"):
                    end += 1
                return i, end, argv[i + 1 : end]
    return None


def model_args(argv: list[str]) -> dict[str, str]:
    """--model_args as lm-eval reads them: `k=v,k2=v2`, or several `k=v` words."""
    span = _span(argv, *MODEL_ARGS)
    words = ",".join(span[2]) if span else ""
    return dict(part.split("=", 1) for part in words.split(",") if "=" in part)


def hf_export_args(argv: list[str]) -> list[str]:
    """The arguments for lm-eval, checked where they name a local `hf` model directory: one lm-eval would
    fail on with a traceback is refused in one line, and our registered class is marked `backend=causal`
    (lm-eval knows only transformers' own causal classes, and says of others that they may need remote code)."""
    model = _span(argv, "--model", "-M")
    args = model_args(argv)
    path = Path(args.get("pretrained", ""))
    if (
        (model[2][0] if model and model[2] else "hf") not in HF_MODELS
        or not args.get("pretrained")
        or not path.is_dir()
    ):
        return argv
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        raise EvalError(
            f"{path} has no readable config.json, so it is not a HuggingFace model directory. "
            "Fix: pass the directory `python -m pretrain.export --format hf` wrote"
        ) from None
    if "tokenizer" not in args and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise EvalError(
            f"{path} has no tokenizer (its run had none with a transformers form: pretrain.export said why), and "
            "lm-eval's hf model needs one. Fix: add tokenizer=DIR (a transformers tokenizer directory) to "
            f"--model_args, or run --model trainable_parts --model_args checkpoint={path}, which reads text with "
            "the run's own tokenizer (a byte-level one included)"
        )
    if model_type != MODEL_TYPE or "backend" in args:
        return argv
    start, end, _ = _span(argv, *MODEL_ARGS)
    merged = ",".join(f"{k}={v}" for k, v in {**args, "backend": "causal"}.items())
    return [*argv[:start], "--model_args", merged, *argv[end:]]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> None:
        args = hf_export_args(argv)
        given = not args or _span(args, "--include_path") is not None
        extra = [] if given else ["--include_path", str(TASK_DIR)]
        sys.argv = ["lm-eval", *args, *extra]  # lm-eval's parser reads sys.argv
        quiet_git_probe()
        cli_evaluate()

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
