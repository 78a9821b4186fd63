"""launch.sh end to end: a two-"node" run on loopback (two launcher invocations, --no-ssh) and a
2-process CPU run that learns WikiText-2 text."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port, read_losses
from fixtures import corpus_lines

from checkpoint import tag_format as ckpt
from common.errors import RecipeError
from pretrain.distributed import cuda_index
from studies.chaos_long import processes_mentioning


def launch_env():
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT", "MASTER_ADDR")
    return dict({k: v for k, v in os.environ.items() if k not in drop}, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def test_two_nodes_on_loopback_train_and_checkpoint(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    run, port = tmp_path / "run", free_port()
    procs = [
        subprocess.Popen(
            [
                "./launch.sh",
                "--cpu",
                "1",
                "--hostfile",
                str(hostfile),
                "--no-ssh",
                "--node-rank",
                str(r),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--",
                "--recipe",
                "recipes/tiny_cpu.yaml",
                "--run-dir",
                str(run),
                "train.max_steps=4",
                "train.eval_every_steps=0",
                "checkpoint.every_steps=2",
                "logging.tensorboard=false",
            ],
            cwd=REPO,
            env=launch_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "--no_ssh --node_rank 0 --master_addr 127.0.0.1" in outs[0]  # the printed command
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4]
    state = ckpt.read_state(run / "checkpoints" / ckpt.tag_for(4))
    assert state["world_size"] == 2 and state["step"] == 4
    assert sorted(read_losses(run)) == [1, 2, 3, 4]
    code = json.loads((run / "code.json").read_text())  # what both nodes agreed on before step 1
    assert [n.split(" (")[0] for n in code["nodes"]] == ["node 0", "node 1"] and len(code["sources_sha256"]) == 64
    assert code["commit"] and code["versions"]["deepspeed"] and code["fingerprint_sha256"]


def test_two_process_cpu_run_learns_text_with_the_wikitext2_recipe(tmp_path):
    """recipes/wikitext2_cpu.yaml as shown, its Hub source overridden by a local folder of text."""
    run, text = tmp_path / "wt", tmp_path / "text"
    text.mkdir()
    for split in ("test", "valid"):
        (text / f"{split}.txt").write_text("\n".join(corpus_lines(2000, split)) + "\n")
    out = subprocess.run(
        [
            "./launch.sh",
            "--cpu",
            "2",
            "--master-port",
            str(free_port()),
            "--",
            "--recipe",
            "recipes/wikitext2_cpu.yaml",
            "--run-dir",
            str(run),
            f"data.source=text:{text}",
            "train.max_steps=60",
            "train.eval_every_steps=60",
            "checkpoint.every_steps=0",
            "logging.every_steps=1",
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = recs[0], recs[-1]
    chance = math.log(256)
    assert first["loss"] > 0.9 * chance
    assert last["step"] == 60 and last["val_loss"] < 0.65 * chance and last["loss"] < 0.65 * chance
    assert {"lr", "tokens_seen", "tokens_per_s", "tflops", "grad_norm"} <= set(last)
    assert any(Path(run / "tb").iterdir())


def test_sigterm_to_launch_sh_checkpoints_every_rank(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            "./launch.sh",
            "--cpu",
            "2",
            "--master-port",
            str(free_port()),
            "--",
            "--recipe",
            "recipes/tiny_cpu.yaml",
            "--run-dir",
            str(run),
            "train.max_steps=1000",
            "train.eval_every_steps=0",
            "checkpoint.every_steps=0",
            "logging.tensorboard=false",
        ],
        cwd=REPO,
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    m = run / "metrics.jsonl"
    deadline = time.time() + 200
    while time.time() < deadline and not (m.is_file() and len(m.read_text().splitlines()) >= 3):
        assert proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=200)[0]
    assert "signal received: saving a checkpoint" in out, out[-3000:]
    steps = read_losses(run)
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None and ckpt.read_state(latest)["step"] == max(steps) < 1000
    assert len(list(latest.glob("rng/rank*.pt"))) == 2


def world_info(n: int) -> str:
    """DeepSpeed's encoding of N ranks on this node (its runner's `encode_world_info`)."""
    return base64.urlsafe_b64encode(json.dumps({"localhost": list(range(n))}).encode()).decode()


@pytest.mark.parametrize(
    "opts, expect",
    [
        (["--cpu", "2"], f"deepspeed.launcher.launch --world_info={world_info(2)} --master_addr=127.0.0.1 "),
        (
            ["--gpus", "8", "--master-port", "29999"],
            f"--world_info={world_info(8)} --master_addr=127.0.0.1 --master_port=29999 --module pretrain.train",
        ),
        (
            ["--hostfile", "hf", "--gpus", "8", "--master-addr", "node0"],
            "--hostfile hf --num_gpus 8 --master_addr node0",
        ),
        (
            ["--no-ssh", "--hostfile", "hf", "--node-rank", "1", "--master-addr", "10.0.0.1", "--gpus", "4"],
            "--hostfile hf --num_gpus 4 --no_ssh --node_rank 1 --master_addr 10.0.0.1",
        ),
    ],
)
def test_launch_sh_prints_the_exact_command(opts, expect):
    out = subprocess.run(
        ["./launch.sh", *opts, "--dry-print", "--", "--recipe", "recipes/tiny_cpu.yaml", "train.lr=1e-3"],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("+ ") and expect in out.stdout
    assert out.stdout.rstrip().endswith("--recipe recipes/tiny_cpu.yaml train.lr=1e-3")


def test_launch_sh_states_the_nccl_failure_settings_for_gpu_runs():
    def dry(opts, **env):
        out = subprocess.run(
            ["./launch.sh", *opts, "--dry-print", "--", "--recipe", "recipes/tiny_cpu.yaml"],
            cwd=REPO,
            env=dict(launch_env(), **env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    # the watchdog aborts the communicators, the trainer speaks and exits (pretrain/distributed.py NCCL_ENV)
    nccl = "env TORCH_NCCL_ASYNC_ERROR_HANDLING=2 TORCH_NCCL_PROPAGATE_ERROR=1 TORCH_NCCL_BLOCKING_WAIT=0 "
    assert dry(["--gpus", "2"]).startswith("+ " + nccl)
    assert dry(["--hostfile", "hf", "--gpus", "8"]).startswith("+ " + nccl)
    assert "TORCH_NCCL" not in dry(["--cpu", "2"])  # gloo: nothing to set
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 " in dry(["--gpus", "2"], TORCH_NCCL_ASYNC_ERROR_HANDLING="3")


def test_launch_sh_refuses_incomplete_forms():
    for opts in (["--slurm"], ["--no-ssh", "--hostfile", "hf"], []):
        env = {k: v for k, v in launch_env().items() if not k.startswith("SLURM_")}
        out = subprocess.run(
            ["./launch.sh", *opts, "--", "--recipe", "x"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and out.stderr, opts


def test_slurm_form_rendezvous_from_slurm_variables(tmp_path):
    """`launch.sh --slurm` under a stand-in srun (2 tasks on this host) trains with world size 2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n# stand-in: start 2 tasks locally with the variables srun sets\n"
        "shift  # --kill-on-bad-exit=1\n"
        'for i in 0 1; do SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NTASKS=2 SLURM_NNODES=1 "$@" & done\n'
        "rc=0; for j in $(jobs -p); do wait $j || rc=$?; done; exit $rc\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    run = tmp_path / "run"
    env = dict(
        launch_env(),
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS_PER_NODE="2",
    )
    out = subprocess.run(
        [
            "./launch.sh",
            "--slurm",
            "--master-port",
            str(free_port()),
            "--",
            "--recipe",
            "recipes/tiny_cpu.yaml",
            "--run-dir",
            str(run),
            "train.max_steps=2",
            "train.eval_every_steps=0",
            "logging.tensorboard=false",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.startswith("+ env MASTER_ADDR=127.0.0.1 MASTER_PORT=") and " srun " in out.stdout
    assert ckpt.read_state(ckpt.latest_checkpoint(run))["world_size"] == 2


@pytest.mark.parametrize("tasks,gpus", [("1", "8"), ("4(x2)", "a100:8")])
def test_slurm_refuses_tasks_per_node_other_than_its_gpus(tmp_path, tasks, gpus):
    """--ntasks-per-node=1 on 8-GPU nodes would train on one GPU per node: refused before srun runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\ntouch {tmp_path}/srun_ran\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(launch_env(), PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="n0")
    env.update({"SLURM_TASKS_PER_NODE" if "(" in tasks else "SLURM_NTASKS_PER_NODE": tasks})
    env.update({"SLURM_GPUS_PER_NODE" if ":" in gpus else "SLURM_GPUS_ON_NODE": gpus})
    out = subprocess.run(
        ["./launch.sh", "--slurm", "--master-port", "29999", "--", "--recipe", "recipes/tiny_cpu.yaml"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and not (tmp_path / "srun_ran").exists()
    want = f"{tasks.split('(')[0]} task(s) per node but 8 GPU(s) per node"
    assert (
        out.stderr.startswith("error: launch.sh --slurm: ")
        and want in out.stderr
        and "--ntasks-per-node=8" in out.stderr
    )


def _printed_port(out: str) -> int:
    """The rendezvous port in launch.sh's printed command (--master_port P or MASTER_PORT=P)."""
    return int(re.search(r"(?:--master_port[ =]|MASTER_PORT=)(\d+)", out).group(1))


def test_concurrent_local_launches_get_their_own_ports(tmp_path):
    """Two single-node jobs started at once on one machine, no --master-port: each rendezvous on a free
    port of its own (a fixed 29500 made the second one fail to bind, or join the first)."""
    procs = [
        subprocess.Popen(
            [
                "./launch.sh",
                "--cpu",
                "1",
                "--",
                "--recipe",
                "recipes/tiny_cpu.yaml",
                "--run-dir",
                str(tmp_path / f"run{i}"),
                "train.max_steps=20",
                "train.eval_every_steps=0",
                "checkpoint.every_steps=0",
                "logging.tensorboard=false",
            ],
            cwd=REPO,
            env=launch_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    ports = [_printed_port(out) for out in outs]
    assert ports[0] != ports[1] and all(1024 < q < 65536 for q in ports)
    for i in (0, 1):
        assert sorted(read_losses(tmp_path / f"run{i}")) == list(range(1, 21))


def _slurm_dry_print(job_id: str, *extra: str, **env_extra: str) -> str:
    env = dict(
        launch_env(),
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NODELIST="node[01-02]",
        SLURM_NTASKS="8",
        SLURM_NNODES="2",
        **env_extra,
    )
    out = subprocess.run(
        [
            "./launch.sh",
            "--slurm",
            "--master-addr",
            "node01",
            *extra,
            "--dry-print",
            "--",
            "--recipe",
            "recipes/tiny_cpu.yaml",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_slurm_port_is_a_function_of_the_job():
    """Every node of one Slurm job derives the same port; the tasks of an array job (each its own
    SLURM_JOB_ID) and other jobs derive other ports; --master-port overrides the derivation."""
    port = _printed_port(_slurm_dry_print("73105", SLURM_ARRAY_JOB_ID="73100", SLURM_ARRAY_TASK_ID="5"))
    assert 1024 < port < 65536
    assert _printed_port(_slurm_dry_print("73105", SLURM_ARRAY_JOB_ID="73100", SLURM_ARRAY_TASK_ID="5")) == port
    assert _printed_port(_slurm_dry_print("73105", SLURM_NODEID="1", SLURM_PROCID="4")) == port
    others = {
        _printed_port(_slurm_dry_print(str(j), SLURM_ARRAY_JOB_ID="73100", SLURM_ARRAY_TASK_ID=str(j - 73100)))
        for j in range(73100, 73116)
    }
    assert len(others) == 16
    assert _printed_port(_slurm_dry_print("73105", "--master-port", "29999")) == 29999
    out = _slurm_dry_print("73105")
    assert (
        out.startswith(
            f"+ env MASTER_ADDR=node01 MASTER_PORT={port} TORCH_NCCL_ASYNC_ERROR_HANDLING=2 "
            "TORCH_NCCL_PROPAGATE_ERROR=1 TORCH_NCCL_BLOCKING_WAIT=0 srun "
        )
        and len(out.splitlines()) == 1
    )


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads live processes from /proc")
@pytest.mark.parametrize("victim", ["launch.sh group", "per-node launcher"])
def test_sigkill_of_a_launcher_stops_every_rank_after_a_checkpoint(tmp_path, victim):
    """SIGKILL to launch.sh's process group (an OOM kill, a lost login shell) kills only the shell:
    DeepSpeed's runner, its per-node launcher and the ranks sit in a process group of their own; and
    SIGKILL to that per-node launcher (deepspeed.launcher.launch, the ranks' parent) leaves its ranks
    behind. Either way the ranks must notice, save a complete checkpoint through the signal path, and
    exit, so no orphan keeps a device or writes into a run dir that a restarted job owns."""
    run = tmp_path / "orphan_run"
    log = open(tmp_path / "launch.log", "w")
    proc = subprocess.Popen(
        [
            "./launch.sh",
            "--cpu",
            "2",
            "--",
            "--recipe",
            "recipes/tiny_cpu.yaml",
            "--run-dir",
            str(run),
            "train.max_steps=100000",
            "train.eval_every_steps=0",
            "checkpoint.every_steps=0",
            "logging.tensorboard=false",
        ],
        cwd=REPO,
        env=launch_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        m = run / "metrics.jsonl"
        deadline = time.time() + 200
        while time.time() < deadline and not (m.is_file() and len(m.read_text().splitlines()) >= 3):
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            time.sleep(0.1)
        ranks = {
            p
            for p, cmd in processes_mentioning(str(run)).items()
            if "-m pretrain.train" in cmd and "deepspeed.launcher" not in cmd
        }
        assert len(ranks) == 2
        if victim == "launch.sh group":
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        else:
            [launcher] = [p for p, cmd in processes_mentioning(str(run)).items() if "deepspeed.launcher.launch" in cmd]
            os.kill(launcher, signal.SIGKILL)
        deadline = time.time() + 60
        while time.time() < deadline and processes_mentioning(str(run)):
            time.sleep(0.2)
        left = processes_mentioning(str(run))
        assert not left, f"still running 60 s after the launcher died: {left}"
    finally:
        for pid in processes_mentioning(str(run)):  # only what this test started (its unique run dir)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    out = (tmp_path / "launch.log").read_text()
    assert "signal received: saving a checkpoint" in out, out[-3000:]
    steps = read_losses(run)
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None and ckpt.read_state(latest)["step"] == max(steps) < 100000
    assert len(list(latest.glob("rng/rank*.pt"))) == 2
    tags = [p for p in ckpt.ckpt_root(run).iterdir() if p.is_dir()]
    assert all(ckpt.is_complete(p) for p in tags), tags  # no partial checkpoint left behind


def test_a_finished_rank_exits_with_its_code_and_its_output_flushed():
    """pretrain.train leaves through exit_process (no interpreter teardown, which can abort a
    finished rank); whatever it printed, to a pipe (block-buffered), must still arrive."""
    code = (
        "import sys; from pretrain.distributed import exit_process; "
        "print('done: out', end=''); print('done: err', file=sys.stderr, end=''); exit_process(3)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as under a launcher
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    assert out.stdout == "done: out"
    assert out.stderr.endswith("done: err")


def test_launch_sh_refuses_more_gpus_than_the_node_shows(tmp_path):
    """`--gpus 8` on a one-GPU node: one error line before any rank starts (not 8 ranks on cuda:0)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n")
    smi.chmod(0o755)
    ranks_started = tmp_path / "ranks"
    # a stand-in interpreter: records the runner it is asked to start instead of starting ranks
    py = fake_bin / "python"
    py.write_text(
        f'#!/bin/sh\ncase "$*" in *deepspeed.launcher*) echo "$*" >> {ranks_started}; exit 0;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    py.chmod(0o755)
    env = {k: v for k, v in launch_env().items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=f"{fake_bin}:{env['PATH']}", PYTHON=str(py))

    def launch(gpus: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["./launch.sh", "--gpus", gpus, "--", "--recipe", "recipes/tiny_cpu.yaml"],
            cwd=REPO,
            env=dict(env, **extra),
            capture_output=True,
            text=True,
            timeout=60,
        )

    out = launch("8")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == "error: --gpus 8 but this node shows 1 GPU(s) (nvidia-smi -L). Fix: --gpus 1\n"
    assert out.stdout == "" and not ranks_started.exists()
    # CUDA_VISIBLE_DEVICES narrows what the node shows
    hidden = launch("1", CUDA_VISIBLE_DEVICES="")
    assert hidden.returncode == 2 and hidden.stderr.startswith("error: --gpus 1 but this node shows 0 GPU(s)")
    assert "Fix: run on a GPU node, or --cpu N" in hidden.stderr and not ranks_started.exists()
    # within the count, DeepSpeed's launcher is started
    assert launch("1").returncode == 0
    assert f"--world_info={world_info(1)} " in ranks_started.read_text()


@pytest.mark.parametrize(
    "env,visible,want",
    [
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, 8, 3),  # one process per GPU
        ({"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}, 1, 0),  # each process sees its own GPU (--gpus-per-task)
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 8, None),  # --ntasks-per-node=1 on an 8-GPU node
        ({"LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "8"}, 4, None),  # more processes than GPUs
    ],
)
def test_each_rank_gets_its_own_gpu_or_a_one_line_refusal(monkeypatch, env, visible, want):
    for k, v in {**env, "RANK": "11"}.items():
        monkeypatch.setenv(k, v)
    if want is not None:
        assert cuda_index(visible) == want
        return
    with pytest.raises(
        RecipeError,
        match=rf"rank 11 on .*: {env['LOCAL_WORLD_SIZE']} processes on this node .* but {visible} GPUs visible",
    ):
        cuda_index(visible)


def test_two_nodes_that_do_not_share_the_run_dir_stop_in_one_line_not_a_hang(tmp_path):
    """Two ranks as two loopback "nodes" whose run dirs differ (the same relative --run-dir under another
    working directory, as node-local disks would be): every rank ends within seconds with one error line
    naming the rank that does not see rank 0's run dir, long before the collective timeout."""
    port, procs = free_port(), []
    for rank in (0, 1):
        node = tmp_path / f"node{rank}"
        node.mkdir()
        env = dict(
            launch_env(), PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        cmd = [sys.executable, "-m", "pretrain.train", "--recipe", str(REPO / "recipes/tiny_cpu.yaml")]
        cmd += ["--run-dir", "runs/shared", "train.max_steps=2", "parallel.timeout_s=600", "logging.tensorboard=false"]
        procs.append(
            subprocess.Popen(cmd, cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    start = time.monotonic()
    outs = [p.communicate(timeout=240) for p in procs]
    assert time.monotonic() - start < 240
    for p, (out, err) in zip(procs, outs):
        lines = [x for x in err.splitlines() if x.startswith("error: ")]
        assert p.returncode == 2 and len(lines) == 1, err[-2000:]
        assert "rank 1 on " in lines[0] and "Fix:" in lines[0]
        own = tmp_path / "node1" / "runs" / "shared"
        assert f"does not see rank 0's run dir {tmp_path / 'node0' / 'runs' / 'shared'} (its own is {own})" in lines[0]
    assert not (tmp_path / "node1" / "runs" / "shared" / "checkpoints").exists()
    assert not (tmp_path / "node0" / "runs" / "shared").exists()  # rank 0's mark went with the run dir it made
