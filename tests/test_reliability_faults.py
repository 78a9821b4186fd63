"""Injected faults: non-finite losses and gradients under each policy, SIGKILL in the middle of a
checkpoint write, no space left while writing a checkpoint (1 and 2 ranks) or a shard, one rank of
two dying or hanging. Each fault is real (a NaN in the loss or only in the gradients, a real signal,
a real filesystem that fills up); the code under test is the production trainer."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, finish_ranks, free_port, read_losses, run_ranks, start_ranks, wait_for_steps
from fixtures import corpus_lines, make_tokenizer, write_text

from checkpoint import load_for_eval
from checkpoint import tag_format as ckpt
from common.errors import CheckpointWriteFailed, DataError, NonFiniteLoss
from data_pipeline import prepare as prep
from pretrain import bounds, faults
from pretrain.config import RunConfig
from pretrain.distributed import rank_failure_message
from pretrain.train import train

RECIPE = "recipes/tiny_cpu.yaml"
FAST = ["train.eval_every_steps=0", "logging.tensorboard=false"]
OVER = FAST + ["train.max_steps=8", "checkpoint.every_steps=3", "checkpoint.keep_last=0"]


@pytest.fixture
def inject(monkeypatch):
    def set_faults(**spec):
        monkeypatch.setenv(faults.ENV, json.dumps(spec))

    return set_faults


def plain_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT")
    }
    return dict(env, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)


def weights_finite(tag_dir) -> bool:
    model, _ = load_for_eval(tag_dir)
    return all(torch.isfinite(t).all() for t in model.state_dict().values())


# ---- non-finite losses ------------------------------------------------------------------


def test_nan_skip_and_rollback_drop_the_bad_batches_and_never_update_with_nan(tmp_path, inject):
    inject(nan_batches=[4, 6])  # batches 4 and 6 of the data order give NaN loss and NaN gradients
    skip = train(RECIPE, OVER + ["train.nan_policy=skip"], run_dir=tmp_path / "skip", resume="never")
    back = train(RECIPE, OVER + ["train.nan_policy=rollback"], run_dir=tmp_path / "back", resume="never")
    # skip: steps 5 and 6 train on batches 5 and 7; rollback reloads step 3 and replays without them
    assert sorted(read_losses(tmp_path / "skip")) == list(range(1, 9))
    assert read_losses(tmp_path / "skip") == read_losses(tmp_path / "back")  # bitwise, step for step
    assert all(math.isfinite(v) for v in read_losses(tmp_path / "skip").values())
    for run, res in (("skip", skip), ("back", back)):
        assert weights_finite(res.last_checkpoint)
        assert ckpt.read_state(res.last_checkpoint)["nan_skipped"] == [32, 48]  # global sample positions
        events = [json.loads(x) for x in (tmp_path / run / "nonfinite.jsonl").read_text().splitlines()]
        assert {(e["samples"], e["action"]) for e in events} == {
            (32, run if run == "skip" else "rollback"),
            (48, run if run == "skip" else "rollback"),
        }
    # the skip really is a skip: without the fault, steps 1-4 are the same and step 5 differs
    inject()
    clean = train(
        RECIPE, FAST + ["train.max_steps=5", "checkpoint.save_final=false"], run_dir=tmp_path / "clean", resume="never"
    )
    assert [clean.losses[s] for s in range(1, 5)] == [skip.losses[s] for s in range(1, 5)]
    assert clean.losses[5] != skip.losses[5]


@pytest.mark.parametrize("ds_config", ["zero0", "pipeline"])
def test_nan_under_two_pipeline_stages_skips_the_update_on_both(tmp_path, inject, ds_config):
    """Under pipeline parallelism the loss exists only on the last stage, after the backward: the
    step gate checks every stage's gradients and both stages skip the update together (with
    ZeRO-0 the gate is the only guard; ZeRO-1's own overflow check also skips)."""
    inject(nan_batches=[4])
    skip = OVER + ["train.nan_policy=skip", f"parallel.ds_config={ds_config}"]
    if ds_config == "zero0":
        skip.append("train.grad_clip=0")  # pipeline + ZeRO-0 refuses clipping (pretrain/layout.py)
    run_ranks(["--recipe", RECIPE, "--run-dir", str(tmp_path / "pipe"), "parallel.pipeline_stages=2", *skip])
    one = train(RECIPE, skip, run_dir=tmp_path / "one", resume="never")
    got = read_losses(tmp_path / "pipe")
    assert sorted(got) == list(range(1, 9))
    for s in range(1, 9):  # the same batches skipped, the same updates made
        assert got[s] == pytest.approx(one.losses[s], rel=1e-5, abs=1e-5), s
    last = tmp_path / "pipe" / "checkpoints" / ckpt.tag_for(8)
    assert weights_finite(last)
    assert ckpt.read_state(last)["nan_skipped"] == [32]
    events = [json.loads(x) for x in (tmp_path / "pipe" / "nonfinite.jsonl").read_text().splitlines()]
    assert [(e["samples"], e["action"]) for e in events] == [(32, "skip")]


def test_nan_stop_names_step_and_batch_and_keeps_the_last_checkpoint(tmp_path, inject):
    inject(nan_batches=[4])
    with pytest.raises(NonFiniteLoss, match=r"step 5 \(batch of global samples \[32, 40\).*nan_policy"):
        train(RECIPE, OVER + ["train.nan_policy=stop"], run_dir=tmp_path, resume="never")
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3]
    assert weights_finite(ckpt.latest_checkpoint(tmp_path))


def test_repeated_nans_stop_the_run(tmp_path, inject):
    inject(nan_batches=[2, 3, 4])
    with pytest.raises(NonFiniteLoss, match="3 non-finite steps.*max_nan_skips=2"):
        train(RECIPE, OVER + ["train.nan_policy=skip", "train.max_nan_skips=2"], run_dir=tmp_path, resume="never")


@pytest.mark.parametrize("ds_config", ["zero0", "zero1", "zero2", "zero3"])
def test_nan_in_the_gradients_only_skips_the_update_on_every_layout(tmp_path, inject, ds_config):
    """A backward that overflows while the loss stays finite: the loss check cannot see it; the
    gradient-norm check must. Without ZeRO, clipping by a NaN norm would make every gradient NaN
    and the update would be applied; under ZeRO, DeepSpeed skips the step but the run must know."""
    over = OVER + ["train.nan_policy=skip", f"parallel.ds_config={ds_config}"]
    inject(nan_grad_batches=[4])  # batch 4: finite loss, NaN gradients
    grads = train(RECIPE, over, run_dir=tmp_path / "grads", resume="never")
    inject(nan_batches=[4])  # the same batch with a NaN loss, which the loss check skips
    loss = train(RECIPE, over, run_dir=tmp_path / "loss", resume="never")
    assert sorted(grads.losses) == list(range(1, 9))
    assert grads.losses == loss.losses  # bitwise: the same batch skipped, the same updates made
    assert weights_finite(grads.last_checkpoint)
    assert ckpt.read_state(grads.last_checkpoint)["nan_skipped"] == [32]
    [event] = [json.loads(x) for x in (tmp_path / "grads" / "nonfinite.jsonl").read_text().splitlines()]
    assert event["samples"] == 32 and event["action"] == "skip"
    assert math.isfinite(float(event["loss"])) and not math.isfinite(float(event["grad_norm"]))


def test_nan_in_the_gradients_only_stops_the_run_naming_it(tmp_path, inject):
    inject(nan_grad_batches=[4])
    with pytest.raises(
        NonFiniteLoss,
        match=r"non-finite gradient norm \(nan; loss [\d.]+ is finite\) at optimizer "
        r"step 5 \(batch of global samples \[32, 40\)",
    ):
        train(RECIPE, OVER + ["parallel.ds_config=zero0"], run_dir=tmp_path, resume="never")
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3]


# ---- checkpoints by the clock: a hard crash loses at most checkpoint.every_minutes ------------

TIMED = FAST + [
    "checkpoint.every_steps=0",
    "checkpoint.every_minutes=0.0005",
    "checkpoint.keep_last=0",
    "checkpoint.save_final=false",
    "train.max_steps=12",
]


def assert_saved_by_the_clock(run, ranks: int):
    saved = ckpt.list_checkpoints(run)
    assert len(saved) >= 2, saved
    times = [ckpt.read_state(p)["time"] for _, p in saved]
    assert all(b - a >= 0.0005 * 60 * 0.99 for a, b in zip(times, times[1:])), times
    for _, p in saved:  # every rank took part in every save
        assert ckpt.verify(p) == [] and sorted(f.name for f in (p / "rng").iterdir()) == [
            f"rank{r}.pt" for r in range(ranks)
        ]


def test_checkpoints_every_minutes_by_the_clock(tmp_path):
    assert RunConfig().checkpoint.every_minutes > 0  # on by default: a hard crash never loses the whole run
    train(RECIPE, TIMED, run_dir=tmp_path / "timed", resume="never")
    assert_saved_by_the_clock(tmp_path / "timed", 1)
    train(RECIPE, TIMED + ["checkpoint.every_minutes=0"], run_dir=tmp_path / "off", resume="never")
    assert ckpt.list_checkpoints(tmp_path / "off") == []


def test_checkpoints_every_minutes_on_two_ranks_agree(tmp_path):
    # rank 0's clock decides and the all-reduce of the step's flags tells every rank: were the
    # ranks to decide alone, one would enter the (collective) save while the other trains on
    run_ranks(["--recipe", RECIPE, "--run-dir", str(tmp_path / "run"), *TIMED, "parallel.timeout_s=60"])
    assert_saved_by_the_clock(tmp_path / "run", 2)


# ---- SIGKILL in the middle of a checkpoint write ----------------------------------------


def test_sigkill_mid_checkpoint_write_keeps_previous_and_resume_ignores_partial(tmp_path):
    over = OVER + ["train.max_steps=9", "checkpoint.keep_last=1"]
    run = tmp_path / "run"
    env = plain_env(**{faults.ENV: json.dumps({"save_pause_s": 60, "save_pause_steps": [6]})})
    proc = subprocess.Popen(
        [sys.executable, "-m", "pretrain.train", "--recipe", RECIPE, "--run-dir", str(run), *over],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial = run / "checkpoints" / ckpt.tag_for(6)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (partial / "rng" / "rank0.pt").is_file():
            assert proc.poll() is None, "training ended before the checkpoint of step 6"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # DeepSpeed's files are written, COMPLETE is not
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert partial.is_dir() and not ckpt.is_complete(partial)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [3]
    assert ckpt.latest_checkpoint(run).name == ckpt.tag_for(3)
    assert weights_finite(ckpt.latest_checkpoint(run))  # the previous one still loads
    resumed = train(RECIPE, over, run_dir=run, resume="auto")
    assert resumed.resumed_from.name == ckpt.tag_for(3)
    ref = train(RECIPE, over, run_dir=tmp_path / "ref", resume="never")
    assert read_losses(run) == ref.losses
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [9]


# ---- no space left (a real filesystem that fills up) -------------------------------------

MiB = 1 << 20


def du(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("background", [False, True])
def test_disk_full_during_checkpoint_stops_clearly_and_keeps_the_last_good(tmp_path, small_tmpfs, background):
    # The run dir is on a small tmpfs: a full disk makes torch.save raise RuntimeError (not
    # OSError), safetensors SafetensorError, Python writes OSError: what a real run meets. A background
    # save that fails raises where the run next waits for it (the save of step 8), with the same message.
    over = [*OVER, f"checkpoint.background={str(background).lower()}"]
    fs = small_tmpfs(tmp_path / "fs", 64 * MiB)
    run = fs.path / "run"
    first = train(RECIPE, over, run_dir=run, resume="never", stop_after_steps=3)  # checkpoint of step 3
    assert first.last_checkpoint.name == ckpt.tag_for(3)
    fs.resize(fs.used() + du(first.last_checkpoint) // 2)  # room for half a checkpoint more
    with pytest.raises(
        CheckpointWriteFailed,
        match=r"could not write checkpoint step_00000006 \(rank 0: \w+Error.*"
        r"free on that filesystem\).*step_00000003 is untouched.*"
        r"Fix: free space.*--resume auto",
    ):
        train(RECIPE, over, run_dir=run, resume="auto")
    assert not (run / "checkpoints" / ckpt.tag_for(6)).exists()  # the partial files were removed
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [3] and ckpt.verify(ckpt.latest_checkpoint(run)) == []
    assert weights_finite(ckpt.latest_checkpoint(run))
    fs.resize(64 * MiB)  # space freed: the run continues from step 3
    resumed = train(RECIPE, over, run_dir=run, resume="auto")
    assert resumed.resumed_from.name == ckpt.tag_for(3) and resumed.final_step == 8
    ref = train(RECIPE, over, run_dir=tmp_path / "ref", resume="never")
    assert read_losses(run) == ref.losses  # bitwise, as if the disk had never filled


@pytest.mark.parametrize("background", [False, True])
def test_disk_full_on_two_ranks_every_rank_abandons_the_checkpoint_at_once(tmp_path, small_tmpfs, background):
    fs = small_tmpfs(tmp_path / "fs", 64 * MiB)
    run = fs.path / "run"
    args = ["--recipe", RECIPE, "--run-dir", str(run), *OVER, "parallel.ds_config=zero1", "parallel.timeout_s=900"]
    args.append(f"checkpoint.background={str(background).lower()}")
    run_ranks([*args, "train.max_steps=3"])  # a complete checkpoint of step 3
    fs.resize(fs.used() + du(run / "checkpoints" / ckpt.tag_for(3)) // 2)
    t0 = time.time()
    procs = start_ranks(args)  # --resume auto: steps 4-6, the save of 6 fails
    outs = finish_ranks(procs)
    waited = time.time() - t0
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 3, f"rank {r}:\n{out[-3000:]}"
        assert re.search(
            r"error: could not write checkpoint step_00000006 \(rank \d: \w+Error.*every rank abandoned "
            r"it.*step_00000003 is untouched.*--resume auto",
            out,
        ), f"rank {r}:\n{out[-3000:]}"
        assert "another rank died or hangs" not in out
    assert waited < 300 < 900  # both stopped at once, not after parallel.timeout_s
    assert not (run / "checkpoints" / ckpt.tag_for(6)).exists()
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [3]
    assert ckpt.newest_good_checkpoint(run) == (run / "checkpoints" / ckpt.tag_for(3), [])


@pytest.mark.parametrize("workers", [1, 2])
def test_disk_full_during_shard_write_keeps_written_shards_and_rerun_is_identical(tmp_path, small_tmpfs, workers):
    tok = make_tokenizer(tmp_path / "tok")
    write_text(tmp_path / "corpus" / "a.txt", corpus_lines(2000))
    ref = tmp_path / "ref"
    prep.prepare([str(tmp_path / "corpus")], tok, ref, shard_tokens=16_000, progress=False)
    ref_shards = json.loads((ref / "manifest.json").read_text())["shards"]
    assert len(ref_shards) >= 4

    def pages(f):
        return -(-f.stat().st_size // 4096) * 4096

    # room for the first two shards, the progress file (twice, for its atomic rewrite), half the third shard
    room = sum(pages(ref / f"{s['name']}.{x}") for s in ref_shards[:2] for x in ("bin", "idx")) + 3 * 4096
    room += (ref / f"{ref_shards[2]['name']}.bin").stat().st_size // 2
    fs = small_tmpfs(tmp_path / "fs", room)
    out = fs.path / "out"
    with pytest.raises(
        DataError,
        match=r"could not write shard_0000\d .*\(No space left on device; .* free there\).*"
        r"Fix: free space.*re-run the same command",
    ):
        prep.prepare([str(tmp_path / "corpus")], tok, out, workers=workers, shard_tokens=16_000, progress=False)
    done = json.loads((out / "progress.json").read_text())["shards"]
    assert done, "no shard was finished before the disk filled"
    assert len(done) < len(ref_shards), "the disk never filled"
    assert done == ref_shards[: len(done)]
    assert not list(out.glob("*.tmp*"))  # the partial shard's files were freed
    before = {p.name: p.read_bytes() for p in out.glob("shard_*")}
    fs.resize(64 * MiB)
    prep.prepare([str(tmp_path / "corpus")], tok, out, workers=workers, shard_tokens=16_000, progress=False)
    after = {p.name: p.read_bytes() for p in sorted(out.glob("shard_*"))}
    assert after == {p.name: p.read_bytes() for p in sorted(ref.glob("shard_*"))}
    assert all(after[n] == b for n, b in before.items())  # nothing written before was damaged


# ---- one rank of two dies or hangs --------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_other_rank_stops_with_a_clear_message_when_one_dies_or_hangs(tmp_path, sig):
    """No parallel.timeout_s: the step bound is derived from the first steps' time (pretrain/bounds.py), here at
    least 5 s (parallel.min_timeout_s; 300 by default), and a frozen peer ends the other rank within it."""
    run = tmp_path / "run"
    procs = start_ranks(
        [
            "--recipe",
            RECIPE,
            "--run-dir",
            str(run),
            *FAST,
            "train.max_steps=400",
            "checkpoint.every_steps=2",
            "parallel.min_timeout_s=5",
            "checkpoint.timeout_s=10",  # a hang inside a save waits the save's timeout, not the step's
        ]
    )
    try:
        wait_for_steps(run, bounds.TIMED_STEPS + 2, procs, timeout=120)  # the bound is derived by then
        t0 = time.time()
        os.kill(procs[1].pid, sig)
        out = procs[0].communicate(timeout=240)[0]
        waited = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert procs[0].returncode == 3 and len(errors) == 1, out[-3000:]
    assert "another rank died or hangs" in errors[0] and "--resume auto" in errors[0], errors[0]
    assert "Last complete checkpoint: " in errors[0] and "Traceback" not in out
    if sig == signal.SIGSTOP:  # only the bound ends a hang: the derived one, in every group
        assert re.search(r"waited more than the step bound of [\d.]+s \(20x the median step of", errors[0]), errors[0]
    assert waited < 60
    assert ckpt.latest_checkpoint(run) is not None


def test_every_process_group_gets_the_run_timeout_not_torchs_30_minute_default(tmp_path):
    # DeepSpeed's data/pipeline/ZeRO groups come from new_group(ranks); each must carry
    # parallel.timeout_s, or a peer hanging inside a sub-group collective holds this rank 30 min.
    code = (
        "import torch, torch.distributed as dist\n"
        "from pretrain.distributed import init_distributed\n"
        "assert init_distributed(torch.device('cpu'), 7.0)\n"
        "for g in (dist.group.WORLD, dist.new_group([0])):\n"
        "    print(g._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
    )
    env = plain_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["7.0", "7.0"]


def test_a_rank_missing_at_the_shutdown_barrier_is_one_line_not_a_traceback(tmp_path):
    """A finished run's ranks meet at a barrier before closing their connections (exit_process); a peer that never
    gets there (it died, or ran another number of steps) ends this rank with the project's message naming the last
    complete checkpoint, not the barrier's traceback."""
    code = (
        "import os, sys, torch\n"
        "from pretrain.distributed import init_distributed, shutdown_distributed\n"
        "from common.cli import print_error\n"
        "from common.errors import RankFailure\n"
        "init_distributed(torch.device('cpu'), 30.0, 60.0)\n"
        "if os.environ['RANK'] == '1':\n"
        "    os._exit(0)\n"
        "try:\n"
        "    shutdown_distributed(finished=True, run_dir=sys.argv[1])\n"
        "except RankFailure as e:\n"
        "    print_error(e)\n"
        "    os._exit(3)\n"
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=REPO,
            env=plain_env(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    out = finish_ranks(procs, timeout=120)[0]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert procs[0].returncode == 3 and "Traceback" not in out and len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: this rank finished the run, but another rank did not reach its end")
    assert "Last complete checkpoint: none" in errors[0] and "Fix:" in errors[0]


def test_a_failure_reported_off_the_main_thread_ends_every_rank_with_the_message(tmp_path, inject):
    """Under NCCL a dead peer is seen by NCCL's watchdog thread while the rank's own thread sits in a CUDA sync
    that never returns (TORCH_NCCL_ASYNC_ERROR_HANDLING=2 aborts the communicators and leaves the process):
    the trainer's watch must end that rank with the project's message naming the last complete checkpoint,
    long before parallel.timeout_s, and the other rank, which sees it go, with its own. The fault injector
    stands in for NCCL's record of the failure (pretrain/faults.py, comm_error_steps)."""
    inject(comm_error_steps=[3], comm_error_rank=1)
    run = tmp_path / "run"
    args = ["--recipe", RECIPE, "--run-dir", str(run), *FAST, "train.max_steps=400", "checkpoint.every_steps=2"]
    procs = start_ranks([*args, "parallel.timeout_s=600"])
    outs = finish_ranks(procs)
    last = f"Last complete checkpoint: {run / 'checkpoints' / ckpt.tag_for(2)}."
    for r, (p, out) in enumerate(zip(procs, outs)):
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert p.returncode == 3 and len(errors) == 1, f"rank {r}:\n{out[-3000:]}"
        assert "another rank died or hangs" in errors[0] and last in errors[0] and "--resume auto" in errors[0]
    assert "NCCL COMM_ERROR injected after step 3" in outs[1]
    assert ckpt.latest_checkpoint(run) == run / "checkpoints" / ckpt.tag_for(2)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_a_slow_checkpoint_write_waits_for_checkpoint_timeout_not_the_step_timeout(tmp_path, inject, background):
    """Rank 1 finishes its part of the save of step 2 18 s after rank 0 (a slow shared filesystem), with a
    step timeout (parallel.timeout_s) of 10 s: rank 0 waits for it in the save's agreement under
    checkpoint.timeout_s and the run completes. Saves held to the step timeout, as before checkpoint.timeout_s
    (its value set equal), stop the run there."""
    inject(save_pause_s=18, save_pause_steps=[2], save_pause_ranks=[1])
    common = [*FAST, "train.max_steps=3", "checkpoint.every_steps=2", "parallel.timeout_s=10"]
    common.append(f"checkpoint.background={str(background).lower()}")
    run = tmp_path / "slow"
    run_ranks(["--recipe", RECIPE, "--run-dir", str(run), *common, "checkpoint.timeout_s=300"])
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 3] and sorted(read_losses(run)) == [1, 2, 3]
    held = tmp_path / "held"
    procs = start_ranks(["--recipe", RECIPE, "--run-dir", str(held), *common, "checkpoint.timeout_s=10"])
    out = finish_ranks(procs[:1])[0]
    procs[1].kill()  # still in its 18 s write: what it does after rank 0 has gone is another test's
    procs[1].communicate()
    assert procs[0].returncode == 3 and "another rank died or hangs" in out, out[-3000:]
    assert ckpt.list_checkpoints(held) == []


def test_a_collective_of_mismatched_sizes_is_named_as_such(tmp_path):
    """gloo's size mismatch (ranks that build different models or read different data) is not reported as a
    dead or hung peer."""
    said = rank_failure_message(
        RuntimeError("[enforce fail at gloo/transport/tcp/pair.cc:446] Received data size doesn't match expected size"),
        "the step bound of 300s",
        tmp_path,
    )
    assert "the ranks sent tensors of different sizes" in said and "died or hangs" not in said, said
    dead = rank_failure_message(RuntimeError("Connection closed by peer"), "the step bound of 300s", tmp_path)
    assert "another rank died or hangs" in dead, dead
