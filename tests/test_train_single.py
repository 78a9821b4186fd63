"""Single-process training (world size 1, in-process and as a real process): exact resume after
kill -9, the freeze schedule across a resume, export, and the MixiT matrix surviving checkpoints."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from conftest import REPO, fault_seed, read_losses

from checkpoint import load_for_eval
from checkpoint import tag_format as ckpt
from common.errors import RecipeError
from data_pipeline.config import parse_data
from data_pipeline.text import TextLoader
from pretrain.export import main as export_main
from pretrain.train import train

RECIPE = "recipes/tiny_cpu.yaml"
FAST = ["train.eval_every_steps=0", "logging.tensorboard=false"]


def plain_env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT")
    }
    return dict(env, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))


OVER12 = FAST + ["train.max_steps=12", "checkpoint.every_steps=3", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def ref12(tmp_path_factory):
    ref = train(RECIPE, OVER12, run_dir=tmp_path_factory.mktemp("ref12"), resume="never")
    assert sorted(ref.losses) == list(range(1, 13))
    return ref


def start_and_signal(run, sig, at_step):
    """Start a real training process, send `sig` once `at_step` steps are logged; return its exit code."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pretrain.train", "--recipe", RECIPE, "--run-dir", str(run), *OVER12],
        cwd=REPO,
        env=plain_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        m = run / "metrics.jsonl"
        if m.is_file() and len(m.read_text().splitlines()) >= at_step:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training finished before the signal"
    proc.send_signal(sig)
    return proc.wait(timeout=120)


def test_kill9_then_resume_auto_is_bitwise_identical(tmp_path, ref12):
    over, ref = OVER12, ref12
    run = tmp_path / "killed"
    start_and_signal(run, signal.SIGKILL, random.Random(fault_seed()).randint(4, 8))
    done = len(read_losses(run))
    resumed = train(RECIPE, over, run_dir=run, resume="auto")
    # the newest checkpoint at or before the kill; when the kill landed while the checkpoint of
    # that very step was being written, the complete one before it
    expected = {ckpt.tag_for(3 * (done // 3))} | ({ckpt.tag_for(done - 3)} if done % 3 == 0 else set())
    assert resumed.resumed_from is not None and resumed.resumed_from.name in expected
    assert read_losses(run) == ref.losses  # bitwise, step for step
    # retention kept the newest complete checkpoints only, and latest points at the final one
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [9, 12]
    assert (run / "checkpoints" / "latest").read_text().strip() == ckpt.tag_for(12)


def test_sigterm_saves_a_checkpoint_at_that_step_and_resume_continues(tmp_path, ref12):
    run = tmp_path / "preempted"
    assert start_and_signal(run, signal.SIGTERM, 4) == 0  # clean exit after saving
    latest = ckpt.latest_checkpoint(run)
    step = ckpt.read_state(latest)["step"]
    assert step == max(read_losses(run)) and 4 <= step < 12
    resumed = train(RECIPE, OVER12, run_dir=run, resume="auto")
    assert resumed.resumed_from == latest
    assert read_losses(run) == ref12.losses


def test_a_plain_run_trains_while_the_port_a_probe_would_pick_is_taken(tmp_path):
    """Runs started together on one machine (a study's side-by-side chains) each make a store: one that
    binds a port probed free a moment earlier can lose it to another (EADDRINUSE, seen on a GPU with 13
    runs at once). Here every probe answers with a port this test holds, so only a run whose store picks
    its own port trains."""
    script = (
        "import socket, sys\n"
        "import common.constants, pretrain.train\n"
        "held = socket.socket(); held.bind(('127.0.0.1', 0)); held.listen()\n"
        "taken = lambda: held.getsockname()[1]\n"
        "common.constants.free_port = pretrain.train.free_port = taken\n"
        "r = pretrain.train.train(sys.argv[1], sys.argv[3:], run_dir=sys.argv[2], resume='never')\n"
        "print('steps', len(r.losses))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, RECIPE, str(tmp_path / "run"), *FAST, "train.max_steps=2"],
        cwd=REPO,
        env=plain_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "steps 2" in out.stdout, out.stderr[-2000:]


def test_freeze_schedule_applies_at_its_step_and_across_resume(tmp_path):
    over = FAST + [
        "model.variant=frozen_qk",
        "model.freeze_schedule=[[4, []]]",
        "train.max_steps=8",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=0",
    ]
    ref = train(RECIPE, over, run_dir=tmp_path / "ref", resume="never")
    part = train(RECIPE, over, run_dir=tmp_path / "split", resume="never", stop_after_steps=4)
    assert part.final_step == 4
    rest = train(RECIPE, over, run_dir=tmp_path / "split", resume="auto")
    assert rest.resumed_from.name == ckpt.tag_for(4)
    assert read_losses(tmp_path / "split") == ref.losses
    init = load_for_eval(tmp_path / "ref" / "checkpoints" / ckpt.tag_for(2))[0].state_dict()
    at4 = load_for_eval(tmp_path / "ref" / "checkpoints" / ckpt.tag_for(4))[0].state_dict()
    at8 = load_for_eval(tmp_path / "ref")[0].state_dict()
    from model import preset
    from model.transformer import build_model

    fresh = build_model(
        preset(
            "tiny",
            variant="frozen_qk",
            vocab_size=at8["embed_tokens.weight"].shape[0],
            max_seq_len=32,
            freeze_schedule=[[4, []]],
        ),
        seed=1234,
    ).state_dict()
    q = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(init[q], fresh[q]) and torch.equal(at4[q], fresh[q])  # frozen for steps 0..3
    assert not torch.equal(at8[q], fresh[q])  # trained from step 4 on


def test_mixit_export_keeps_matrix_and_weights(tmp_path):
    mixit = FAST + ["model.variant=mixit"]
    res = train(RECIPE, mixit + ["train.max_steps=3"], run_dir=tmp_path / "run", resume="never")
    tag = res.last_checkpoint
    model, meta = load_for_eval(tag)
    assert meta["step"] == 3 and meta["variant"] == "mixit" and meta["tokens_seen"] == 3 * 8 * 32
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "native")]) == 0
    native, nmeta = load_for_eval(tmp_path / "native")
    assert nmeta["step"] == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, native.state_dict()[k]) and v.dtype == native.state_dict()[k].dtype
    from model.transformer import build_model

    fresh = build_model(native.cfg, seed=0)
    a = native.layers[1].self_attn.matrix(32, torch.device("cpu"))
    assert torch.equal(a, fresh.layers[1].self_attn.matrix(32, torch.device("cpu")))
    ids = torch.randint(0, native.cfg.vocab_size, (2, 16))
    assert torch.equal(model.eval()(ids), native.eval()(ids))
    state = json.loads((tag / ckpt.STATE).read_text())
    assert state["model_config"]["mixit_seed"] == native.cfg.mixit_seed
    assert export_main(["--checkpoint", str(tag), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    hf, hmeta = load_for_eval(tmp_path / "hf")
    assert hmeta["step"] == 3 and hf.cfg.variant == "mixit"
    assert torch.equal(hf.eval()(ids), model(ids))  # exact in fp32, as the README says
    # resuming under another layout without a universal checkpoint is refused with the fix
    with pytest.raises(RecipeError, match="pretrain.universal"):
        train(RECIPE, mixit + ["train.max_steps=4", "parallel.ds_config=zero2"], run_dir=tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_for_eval(tmp_path)


def test_doc_ids_reach_the_model_in_training(tmp_path):
    """With data.return_doc_ids the trainer's loss is the model's loss with per-document masking and
    position resets (MixiT's too): a step at lr 0 logs exactly the loss of its batch computed by hand
    with the batch's doc_ids, which differs from the loss without them."""
    f = tmp_path / "lines.txt"
    f.write_text("".join(f"{i}+{i % 7}={i + i % 7}\n" for i in range(300)))
    data = {"source": f"text:{f}", "documents": "lines", "return_doc_ids": True, "val_fraction": 0.1}
    over = FAST + [
        "model.variant=mixit",
        f"data={json.dumps(data)}",
        "train.max_steps=1",
        "optim.lr=0",
        "optim.min_lr=0",
    ]
    res = train(RECIPE, over, run_dir=tmp_path / "run", resume="never")
    model, _ = load_for_eval(res.last_checkpoint)  # lr 0: the initial weights
    batch = next(TextLoader(parse_data(data), "train", 32, 8))
    x, y, d = batch["input_ids"], batch["labels"], batch["doc_ids"]
    assert int(d.max()) >= 3  # several documents per window
    with torch.no_grad():
        n = float((y != -100).sum())
        with_docs = float(model(x, labels=y, doc_ids=d, reduction="sum")) / n
        without = float(model(x, labels=y, reduction="sum")) / n
    assert read_losses(tmp_path / "run")[1] == pytest.approx(with_docs, rel=1e-5)
    assert abs(with_docs - without) > 1e-3


@pytest.mark.parametrize("zero", ["zero0", "zero1"])
def test_adam_moments_carry_over_a_freeze_boundary(zero, tmp_path, monkeypatch):
    from pretrain.engine import ModelEngine
    from pretrain.freeze_transitions import optimizer_snapshot

    captured = {}
    orig = ModelEngine.rebuild

    def spy(self, step):
        captured["before"] = optimizer_snapshot(self)
        orig(self, step)
        captured["after"] = optimizer_snapshot(self)

    monkeypatch.setattr(ModelEngine, "rebuild", spy)
    train(
        RECIPE,
        FAST
        + [
            "model.variant=frozen_qk",
            "model.freeze_schedule=[[2, []]]",
            "train.max_steps=3",
            f"parallel.ds_config={zero}",
            "checkpoint.save_final=false",
        ],
        run_dir=tmp_path,
        resume="never",
    )
    (before, step_before), (after, step_after) = captured["before"], captured["after"]
    assert step_before == step_after == 2
    newly = set(after) - set(before)
    assert newly and all(".q_proj." in n or ".k_proj." in n for n in newly)
    for name, moments in before.items():
        for k, v in moments.items():
            assert torch.equal(after[name][k], v), (name, k)
    for name in newly:
        assert all(not v.any() for v in after[name].values())


@pytest.mark.parametrize("zero, fused", [("zero0", True), ("zero2", True), ("zero1", False)])
def test_engine_optimizer_is_torch_adamw_with_the_configured_kernel(zero, fused, tmp_path, monkeypatch):
    from pretrain.engine import ModelEngine

    seen = []
    orig = ModelEngine.build

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen.append(self.inner_optimizer)

    monkeypatch.setattr(ModelEngine, "build", spy)
    train(
        RECIPE,
        FAST
        + [
            "train.max_steps=1",
            f"parallel.ds_config={zero}",
            f"optim.fused={str(fused).lower()}",
            "checkpoint.save_final=false",
        ],
        run_dir=tmp_path,
        resume="never",
    )
    assert len(seen) == 1 and isinstance(seen[0], torch.optim.AdamW)
    assert bool(seen[0].defaults["fused"]) is fused


def test_bf16_on_cpu_trains_and_exports_in_true_dtype(tmp_path):
    over = FAST + ["train.max_steps=3", "model.variant=frozen_qk"]
    fp32 = train(RECIPE, over, run_dir=tmp_path / "fp32", resume="never")
    bf16 = train(RECIPE, over + ["train.precision=bf16"], run_dir=tmp_path / "bf16", resume="never")
    for s in (1, 2, 3):
        assert bf16.losses[s] == pytest.approx(fp32.losses[s], rel=2e-2)
    model, _ = load_for_eval(bf16.last_checkpoint)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert set(dtypes.values()) == {torch.bfloat16}
    ids = torch.randint(0, model.cfg.vocab_size, (1, 8))
    assert torch.isfinite(model(ids).float()).all()


def test_a_run_written_before_a_model_field_existed_resumes(tmp_path):
    """A config.yaml without a field added since (here model.parametrization and mup_base_width) is read
    with that field at its default: the run resumes; a non-default value is still a different run."""
    run = tmp_path / "run"
    train("recipes/tiny_cpu.yaml", ["train.max_steps=2"], run_dir=run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    for k in ("parametrization", "mup_base_width"):
        cfg["model"].pop(k)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert train("recipes/tiny_cpu.yaml", ["train.max_steps=3"], run_dir=run).final_step == 3
    with pytest.raises(RecipeError, match="model.parametrization: there 'standard', here 'mup'"):
        over = ["train.max_steps=4", "model.parametrization=mup", "model.mixit_width_base=null"]
        train("recipes/tiny_cpu.yaml", over, run_dir=run)
