"""Parity with lm-eval's own model: a standard model exported to Hugging Face format, its SentencePiece
tokenizer exported beside it, scored by lm-eval's built-in `hf` model gives the numbers this project's
adapter gives on the native checkpoint (offline tasks: rolling log-likelihood and multiple choice)."""

from __future__ import annotations

import lm_eval
import pytest
from fixtures import corpus_lines, make_tokenizer, write_text
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer

from data_pipeline.prepare import prepare
from data_pipeline.tokenizer import load_tokenizer
from eval.lm_eval_adapter import TASK_DIR, TrainablePartsLM, run_lm_eval, task_config
from pretrain.export import export
from pretrain.train import train

TASKS = ["tp_text", "tp_kv_recall"]


def test_lm_eval_hf_model_on_the_export_equals_the_adapter_on_the_checkpoint(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    write_text(tmp_path / "train.txt", corpus_lines(600, "valid"))
    prepare([str(tmp_path / "train.txt")], tok_dir, tmp_path / "shards", progress=False)
    run = tmp_path / "run"
    over = [f"data.source={tmp_path / 'shards'}", "train.max_steps=6", "checkpoint.every_steps=0"]
    train("recipes/tiny_cpu.yaml", [*over, "model.variant=standard", "logging.tensorboard=false"], run_dir=run)
    out = export(run, tmp_path / "hf", "hf")
    tok, hf_tok = load_tokenizer(tok_dir), AutoTokenizer.from_pretrained(out)
    line = "the river runs past the old mill, and 12 boats."
    assert hf_tok(line, add_special_tokens=False)["input_ids"] == tok.encode(line)
    ours = run_lm_eval(TrainablePartsLM(checkpoint=str(run), batch_size=4), TASKS)
    hf = HFLM(pretrained=str(out), dtype="float32", prefix_token_id=tok.eos_id, device="cpu", batch_size=4)
    res = lm_eval.simple_evaluate(
        model=hf,  # lm-eval's built-in `hf` model; its rolling windows start with the adapter's prefix, EOS
        tasks=[task_config(t) for t in TASKS],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        bootstrap_iters=0,
        verbosity="WARNING",
    )
    for task in TASKS:
        theirs = {k.split(",")[0]: v for k, v in res["results"][task].items() if isinstance(v, float)}
        shared = {k for k in ours[task] if k in theirs and "stderr" not in k}
        assert shared, (ours[task], theirs)
        for k in shared:
            assert theirs[k] == pytest.approx(ours[task][k], rel=1e-4), (task, k)
