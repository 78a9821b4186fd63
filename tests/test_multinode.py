"""What a first multi-node job meets, on loopback "nodes": the environment that reaches a rank DeepSpeed's
ssh/pdsh runner starts on another node, `launch.sh --iface`, and `python -m pretrain.preflight`. ssh, pdsh
and srun are stand-ins that run the remote command on this machine in a fresh environment (env -i), as a
login shell on another node would get it; everything else is the real code."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import REPO, finish_ranks, free_port, rank_env, read_losses

from checkpoint import tag_format as ckpt
from pretrain import rendezvous

# ssh HOST COMMAND: COMMAND in a fresh environment (a login shell on another node keeps nothing of the
# launcher's), plus the lines of $STANDIN/HOST.env, with each "FROM TO" line of $STANDIN/HOST.map applied
# to the command (a node whose filesystem differs); every call is logged to $STANDIN/ssh.log; a node with a
# file $STANDIN/HOST.down cannot be reached
SSH = r"""#!/bin/bash
while [ $# -gt 0 ]; do case "$1" in -o|-p|-l) shift 2 ;; -*) shift ;; *) break ;; esac; done
host=$1; shift; cmd="$*"
echo "$host $cmd" >> "$STANDIN/ssh.log"
[ -f "$STANDIN/$host.down" ] && { echo "ssh: connect to host $host port 22: No route to host" >&2; exit 255; }
extra=()
[ -f "$STANDIN/$host.env" ] && mapfile -t extra < "$STANDIN/$host.env"
if [ -f "$STANDIN/$host.map" ]; then
  while read -r from to; do cmd=${cmd//"$from"/"$to"}; done < "$STANDIN/$host.map"
fi
exec env -i HOME="$HOME" PATH="$PATH" STANDIN="$STANDIN" "${extra[@]}" bash -c "$cmd"
"""

# pdsh -S -f N -w h1,h2 COMMAND: COMMAND through ssh on every host at once, pdsh's %n (the host's index)
# filled in; first the environment that COMMAND's own exports leave for DeepSpeed's launcher (and so for the
# ranks) goes to $STANDIN/env.INDEX (DeepSpeed's pdsh command is `export ...; cd REPO; python ...`)
PDSH = r"""#!/bin/bash
while [ $# -gt 0 ]; do case "$1" in -w) hosts=$2; shift 2 ;; -f) shift 2 ;; -S) shift ;; *) break ;; esac; done
IFS=, read -ra list <<< "$hosts"
cmd="$*"; i=0; pids=()
for h in "${list[@]}"; do
  c=${cmd//%n/$i}
  ssh "$h" "${c/cd \//env > $STANDIN/env.$i; cd /}" & pids+=($!)
  i=$((i + 1))
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


def standins(tmp_path: Path, **scripts: str) -> tuple[Path, dict[str, str]]:
    """A bin dir of stand-in commands and the environment that puts it first on PATH."""
    bin_dir, standin = tmp_path / "bin", tmp_path / "standin"
    bin_dir.mkdir()
    standin.mkdir()
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT", "MASTER_ADDR")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "NCCL_", "GLOO_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", STANDIN=str(standin), OMP_NUM_THREADS="1")
    return standin, env


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_ranks_started_over_pdsh_get_the_runs_environment_and_the_interface(tmp_path):
    """`launch.sh --hostfile F --iface lo` over DeepSpeed's real pdsh runner: each "node" starts its launcher
    in a fresh login environment, which has only what the pdsh command exports. It must hold the variables
    the run needs (OMP_*, HF_*, PYTORCH_*, DS_ACCELERATOR, TORCH_NCCL_*, the interface for NCCL and gloo) and
    the user's own ~/.deepspeed_env, never a credential; the two nodes then train over that interface."""
    standin, env = standins(tmp_path, ssh=SSH, pdsh=PDSH)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("MY_CLUSTER_SETTING=from-deepspeed-env\n\n")
    env.update(
        HOME=str(home),
        DS_ACCELERATOR="cpu",
        HF_HOME=str(tmp_path / "hf"),
        HF_TOKEN="hf_secret",
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
        LAUNCHER_ONLY="not for the ranks",
    )
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    run = tmp_path / "run"
    cmd = ["./launch.sh", "--cpu", "1", "--hostfile", str(hostfile), "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), "--iface", "lo", "--", "--recipe", "recipes/tiny_cpu.yaml"]
    cmd += ["--run-dir", str(run), "train.max_steps=2", "train.eval_every_steps=0", "logging.tensorboard=false"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "deepspeed.launcher.runner" in out.stdout and " DS_ENV_FILE=" in out.stdout  # the printed command
    assert len((standin / "ssh.log").read_text().splitlines()) == 3  # DeepSpeed's ssh check, then one per node
    for node in (0, 1):
        got = read_env(standin / f"env.{node}")
        want = {
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "HF_HOME": str(tmp_path / "hf"),
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "NCCL_SOCKET_IFNAME": "lo",
            "GLOO_SOCKET_IFNAME": "lo",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
            "TORCH_NCCL_PROPAGATE_ERROR": "1",
            "MY_CLUSTER_SETTING": "from-deepspeed-env",
            "PYTHONPATH": str(REPO),  # DeepSpeed's own: the launching directory
        }
        assert {k: got.get(k) for k in want} == want, node
        assert got["PRETRAIN_LAUNCHER"].split()[0] == os.uname().nodename  # watched on the launching host only
        assert not {"HF_TOKEN", "LAUNCHER_ONLY", "DS_ENV_FILE"} & set(got), node
    assert "HF_TOKEN" not in out.stdout + out.stderr
    state = ckpt.read_state(ckpt.latest_checkpoint(run))
    assert state["world_size"] == 2 and sorted(read_losses(run)) == [1, 2]
    assert not Path(re.search(r" DS_ENV_FILE=(\S+) ", out.stdout).group(1)).exists()  # removed at exit


def test_a_value_that_cannot_travel_is_refused_in_one_line(tmp_path):
    """DeepSpeed's runner double-quotes a value for the remote shell without escaping it: `$` would expand
    there. Refused before anything starts, with the variable's name."""
    standin, env = standins(tmp_path, ssh=SSH, pdsh=PDSH)
    env["OMP_PLACES"] = "{0}:$CORES"
    out = subprocess.run(
        ["./launch.sh", "--hostfile", "hf", "--gpus", "8", "--", "--recipe", "recipes/tiny_cpu.yaml"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and out.stdout == "" and not (standin / "ssh.log").exists()
    assert re.fullmatch(r"error: OMP_PLACES cannot travel to the other nodes: .* Fix: unset OMP_PLACES.*\n", out.stderr)


def test_iface_reaches_every_launch_form():
    """--iface sets NCCL's and gloo's interface for local, Slurm and --no-ssh launches too (their ranks
    inherit this shell's environment, so the printed command shows it), and a bad name is one error line."""

    def dry(*opts: str, **env: str) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "GLOO_"))}
        cmd = ["./launch.sh", *opts, "--dry-print", "--", "--recipe", "recipes/tiny_cpu.yaml"]
        return subprocess.run(cmd, cwd=REPO, env=dict(base, **env), capture_output=True, text=True, timeout=60)

    iface = "NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 "
    assert iface in dry("--gpus", "2", "--iface", "ib0").stdout
    assert iface in dry("--cpu", "2", "--iface", "ib0").stdout
    slurm = dry("--slurm", "--master-addr", "n0", "--iface", "ib0", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n0")
    assert iface + "srun " in slurm.stdout
    no_ssh = ["--no-ssh", "--hostfile", "hf", "--node-rank", "1", "--master-addr", "n0", "--gpus", "8"]
    assert iface in dry(*no_ssh, "--iface", "ib0").stdout
    bad = dry("--gpus", "2", "--iface", "eth0;reboot")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --iface 'eth0;reboot' is not an interface name")
    assert "Fix:" in bad.stderr and bad.stdout == ""
    for opts in (["--cpu", "2"], no_ssh):  # where this node starts ranks, it must have the interface: before any
        cmd = ["./launch.sh", *opts, "--iface", "nosuch0", "--", "--recipe", "recipes/tiny_cpu.yaml"]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
        assert re.fullmatch(
            r"error: --iface 'nosuch0': this node has no such network interface \(it has: .*lo.*\)\. Fix: .*\n",
            out.stderr,
        )
    assert "--iface NAME" in subprocess.run(["./launch.sh", "--help"], cwd=REPO, capture_output=True, text=True).stdout


def test_the_writer_group_takes_the_interface_nccl_was_given(monkeypatch):
    """On GPUs the background checkpoint writer's gloo group is the run's only gloo: told nothing, gloo binds
    the address the host name resolves to (often another network, or 127.0.1.1), so it takes NCCL's."""
    from pretrain.distributed import gloo_interface

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so that what gloo_interface sets is undone after
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^docker0,lo")  # an NCCL exclusion list means nothing to gloo
    gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib1")
    gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"  # one set on purpose wins


# ---- python -m pretrain.preflight -----------------------------------------------------------------

NVIDIA_SMI = "#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\necho 'GPU 1: NVIDIA H100 (UUID: GPU-1)'\n"
# srun --nodes=N ... COMMAND: COMMAND once per node of scontrol's list, each in a fresh environment with the
# variable Slurm sets there (SLURMD_NODENAME), from this directory (srun's default)
SRUN = r"""#!/bin/bash
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  env -i HOME="$HOME" PATH="$PATH" SLURMD_NODENAME="$node" "$@" &
done
wait
"""
NODES = ("127.0.0.1", "127.0.0.2")


def preflight(tmp_path, *opts: str, node2: dict[str, str] | None = None, slots: int = 2, env_extra=None):
    """`python -m pretrain.preflight` over the loopback "nodes" of a hostfile (stand-in ssh and nvidia-smi: 2
    GPUs each), the second node changed by `node2`: {"env": lines, "map": "FROM TO" lines, "down": ""}."""
    standin, env = standins(tmp_path, ssh=SSH, **{"nvidia-smi": NVIDIA_SMI})
    for kind, text in (node2 or {}).items():
        (standin / f"{NODES[1]}.{kind}").write_text(text)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots={slots}\n" for h in NODES))
    run = opts[opts.index("--run-dir") + 1] if "--run-dir" in opts else str(tmp_path / "shared" / "run")
    opts = [o for o in opts if o not in ("--run-dir", run)]
    cmd = [sys.executable, "-m", "pretrain.preflight", "--hostfile", str(hostfile), "--recipe", "recipes/tiny_cpu.yaml"]
    out = subprocess.run(
        [*cmd, "--run-dir", run, *opts],
        cwd=REPO,
        env=dict(env, **(env_extra or {})),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out, Path(run)


def one_error(out: subprocess.CompletedProcess) -> str:
    """The run failed with exactly one `error: ... Fix: ...` line on stderr and no traceback."""
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix: " in lines[0], out.stderr
    return lines[0]


def test_preflight_passes_on_nodes_that_agree_and_prints_one_table(tmp_path):
    out, run = preflight(tmp_path, "--iface", "lo")
    assert out.returncode == 0, out.stdout + out.stderr
    table = [line for line in out.stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| node | reached | commit | environment | run dir | gpus | disk | port | interface |"
    assert [row.split(" | ")[0] for row in table[2:]] == [f"| {h}" for h in NODES]
    for row in table[2:]:
        assert "(!)" not in row and "| shared |" in row and "| 2/2 |" in row and "| ok | lo |" in row
        assert "torch " + __import__("torch").__version__ in row
    assert "preflight: 2 node(s) ready for tiny_cpu" in out.stdout
    assert run.is_dir() and not list(run.iterdir())  # its marks are gone


def fake_deepspeed(tmp_path) -> str:
    """A site directory whose DeepSpeed claims another version (a node with another environment)."""
    meta = tmp_path / "site" / "deepspeed-0.0.1.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.0.1\n")
    return str(tmp_path / "site")


def other_checkout(tmp_path) -> str:
    """A git directory with another HEAD (a node whose checkout is at another commit)."""
    other = tmp_path / "other"
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "-c", "user.name=n", "-c", "user.email=n@n", "commit", "-q",
                    "--allow-empty", "-m", "another commit"], check=True)  # fmt: skip
    return str(other / ".git")


@pytest.mark.parametrize(
    "case, check, said",
    [
        ("down", "reached", "did not answer (ssh: connect to host 127.0.0.2 port 22: No route to host)"),
        ("commit", "commit", "runs "),
        ("deepspeed", "environment", "has deepspeed 0.0.1 where 127.0.0.1 has "),
        ("run dir", "run dir", "does not share "),
        ("gpus", "gpus", "shows 1 GPU(s) but the job starts 2 rank(s) there"),
        ("disk", "disk", "one checkpoint of this recipe takes about "),
        ("port", "port", "cannot connect to 127.0.0.1:"),
        ("iface", "interface", "has no interface nosuch0 (it has "),
    ],
)
def test_preflight_names_the_first_failing_check_and_its_fix(tmp_path, small_tmpfs, case, check, said):
    """One node differs in one way; the table marks it and the error line names that check, the node and the
    fix (the checks before it pass, so each case shows its own check)."""
    opts, node2, port = [], {}, free_port()
    shared = tmp_path / "shared" / "run"
    if case == "down":
        node2 = {"down": ""}
    elif case == "commit":
        node2 = {"env": f"GIT_DIR={other_checkout(tmp_path)}\n"}
    elif case == "deepspeed":
        node2 = {"env": f"PYTHONPATH={fake_deepspeed(tmp_path)}\n"}
    elif case == "run dir":  # the same path is another (node-local) directory there
        node2 = {"map": f"{shared} {tmp_path / 'node2-local' / 'run'}\n"}
    elif case == "gpus":
        node2 = {"env": "CUDA_VISIBLE_DEVICES=0\n"}
    elif case == "disk":
        opts = ["--run-dir", str(small_tmpfs(tmp_path / "small", 1 << 20).path / "run")]
    elif case == "port":  # a firewall between the nodes: the second cannot reach rank 0's port
        opts, node2 = ["--master-port", str(port)], {"map": f"--master-port {port} --master-port {free_port()}\n"}
    elif case == "iface":
        opts = ["--iface", "nosuch0"]
    out, run = preflight(tmp_path, *opts, node2=node2)
    line = one_error(out)
    assert line.startswith(f"error: {check}: ") and said in line, line
    failing = [row for row in out.stdout.splitlines() if "(!)" in row]
    assert failing and all(row.startswith(f"| {NODES[1]} ") for row in failing) or case in ("disk", "iface")
    assert not list(Path(run).glob(".preflight-*"))
    assert not (tmp_path / "node2-local").exists()  # a node that does not share the run dir removes its own mark


def test_preflight_inside_slurm_reads_the_allocation(tmp_path):
    """No hostfile inside a Slurm job: the nodes come from SLURM_JOB_NODELIST (scontrol), the ranks per node
    from SLURM_GPUS_ON_NODE, and one srun task per node answers."""
    scontrol = "#!/bin/sh\nprintf 'n0\\nn1\\n'\n"
    standin, env = standins(tmp_path, srun=SRUN, scontrol=scontrol, **{"nvidia-smi": NVIDIA_SMI})
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="n[0-1]", SLURM_GPUS_ON_NODE="2")
    cmd = [sys.executable, "-m", "pretrain.preflight", "--recipe", "recipes/tiny_cpu.yaml"]
    cmd += ["--run-dir", str(tmp_path / "run"), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| n0 ", "| n1 "))]
    assert len(rows) == 2 and all("| 2/2 |" in row and "(!)" not in row for row in rows)
    env["SLURM_GPUS_ON_NODE"] = "4"  # Slurm would start 4 ranks on nodes that show 2 GPUs
    line = one_error(subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300))
    assert (
        line.startswith("error: gpus: n0 shows 2 GPU(s) but the job starts 4 rank(s) there")
        and "--ntasks-per-node" in line
    )


@pytest.mark.parametrize(
    "hostfile, env, said",
    [
        ("n0 slots=8\nn1 8\n", {}, "hostfile:2: 'n1 8' is not 'HOST slots=N'"),
        ("n0 slots=8\nn0 slots=8\n", {}, "is a host listed twice"),
        (None, {}, "no --hostfile and not inside a Slurm allocation"),
    ],
)
def test_preflight_bad_input_is_one_error_line(tmp_path, hostfile, env, said):
    opts = []
    if hostfile is not None:
        (tmp_path / "hostfile").write_text(hostfile)
        opts = ["--hostfile", str(tmp_path / "hostfile")]
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(
        [sys.executable, "-m", "pretrain.preflight", *opts, "--recipe", "recipes/tiny_cpu.yaml", "--cpu"],
        cwd=REPO, env=base, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert said in one_error(out)


# ---- before step 1: the ranks meet within a bound, and agree on the run ------------------------------------

TRAIN = ["--recipe", "recipes/tiny_cpu.yaml", "train.eval_every_steps=0", "logging.tensorboard=false"]


def start_nodes(port: int, args: list[list[str] | None], envs: list[dict] | None = None) -> list[subprocess.Popen]:
    """One rank per loopback "node", as DeepSpeed's launcher starts it there (CROSS_RANK: the node), with that
    node's training arguments and environment; a node whose arguments are None is not started."""
    procs = []
    for node, extra in enumerate(args):
        if extra is None:
            continue
        env = dict(rank_env(node, len(args), port), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", LOCAL_SIZE="1")
        env.update(CROSS_RANK=str(node), **(envs[node] if envs else {}))
        cmd = [sys.executable, "-m", "pretrain.train", *TRAIN, *extra]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return procs


def error_lines(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's one `error:` line; each exited 2 (bad input, not retried) without a traceback."""
    outs = finish_ranks(procs, timeout)
    lines = []
    for p, out in zip(procs, outs):
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
        assert "Fix: " in errors[0], errors[0]
        lines.append(errors[0])
    return lines


def test_nodes_given_different_runs_stop_before_step_1_naming_the_differences(tmp_path):
    """Two loopback nodes through launch.sh --no-ssh; the second runs from a copy of the checkout with RMSNorm
    changed (no git there) and with another learning rate and step count. Both stop before the run dir is
    touched, in one line naming each difference and the node that has each value: trained apart, they would
    have run to the end with different results (the run's config.yaml holding node 0's recipe only)."""
    other = tmp_path / "other"
    for top in ("common", "model", "data_pipeline", "checkpoint", "eval", "pretrain", "ds_configs", "recipes"):
        shutil.copytree(REPO / top, other / top, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "launch.sh", other / "launch.sh")
    layers = other / "model" / "layers.py"
    layers.write_text(layers.read_text().replace("self.eps = eps", "self.eps = 2 * eps", 1))
    hostfile, run, port = tmp_path / "hostfile", tmp_path / "run", free_port()
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    procs, start = [], time.monotonic()
    for node, (where, extra) in enumerate([(REPO, []), (other, ["optim.lr=1e-3", "train.max_steps=7"])]):
        cmd = ["./launch.sh", "--cpu", "1", "--hostfile", str(hostfile), "--no-ssh", "--node-rank", str(node)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--", *TRAIN, "--run-dir", str(run), *extra]
        procs.append(
            subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    lines = error_lines(procs, timeout=300)
    assert time.monotonic() - start < 120
    assert lines[0] == lines[1] and lines[0].startswith("error: the ranks of this job were not given the same run: ")
    said = lines[0]
    assert re.search(
        r"code: sources \w{12} \(commit [^)]+\) on node 0 \(.+\), sources \w{12} \(commit no git\) on node 1", said
    ), said
    assert re.search(r"optim\.lr: 0\.003 on node 0 \(.+\), 0\.001 on node 1 \(.+\)", said), said
    assert re.search(r"train\.max_steps: 20 on node 0 \(.+\), 7 on node 1 \(.+\)", said), said
    assert "python -m pretrain.preflight" in said
    assert not run.exists() or not {"config.yaml", "metrics.jsonl", "checkpoints"} & {p.name for p in run.iterdir()}


@pytest.mark.parametrize("refuser", [0, 1])
def test_a_node_that_refuses_its_input_tells_the_others_at_once(tmp_path, refuser):
    """A node that stops on its input before the ranks meet (node 0: a misspelt key; node 1: an interface it lacks)
    tells the others through the rendezvous store: they stop at once with its line, instead of waiting for it
    (here parallel.rendezvous_timeout_s=120; before, 30 minutes and a C++ traceback). Node 0, whose store it is,
    hosts one for the telling."""
    run = str(tmp_path / "run")
    args = [["--run-dir", run, "parallel.rendezvous_timeout_s=120"] for _ in range(2)]
    envs = [{}, {}]
    if refuser == 0:
        args[0].append("train.max_stepz=3")
    else:
        envs[1] = {"GLOO_SOCKET_IFNAME": "nosuch0"}
    start = time.monotonic()
    lines = error_lines(start_nodes(free_port(), args, envs), timeout=300)
    assert time.monotonic() - start < 60  # not the 120 s bound
    own = lines[refuser].removeprefix("error: ")
    want = (
        "train.max_stepz: unknown key"
        if refuser == 0
        else f"node 1 ({socket.gethostname()}) has no network interface nosuch0"
    )
    assert own.startswith(want), own
    assert lines[1 - refuser] == f"error: node {refuser} ({socket.gethostname()}) stopped before the run began: {own}"


def test_a_node_that_never_arrives_or_a_port_held_by_another_program_is_one_line(tmp_path):
    """Within parallel.rendezvous_timeout_s, each in one line: rank 0 alone names the rank that never arrived;
    rank 1 alone, that nothing answered at rank 0's address; on a port another program holds, rank 0 says so at
    once and rank 1, which reaches that program instead of rank 0's store, says so after the store's handshake
    went unanswered (before: a traceback, and a silent wait for good)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)
    held = holder.getsockname()[1]
    # another job's rendezvous, both of its ranks in: its store answers, so only what it counts tells it apart
    other_port = free_port()
    other_job = dist.TCPStore("127.0.0.1", other_port, 2, True, wait_for_workers=False)
    counted = dist.PrefixStore(f"{rendezvous.PREFIX}0/", other_job)
    for r in range(2):
        counted.set(f"{rendezvous.ARRIVED}/{r}", "node of another job")
    counted.add(rendezvous.ARRIVED, 2)
    bound = ["parallel.rendezvous_timeout_s=8"]
    try:
        start = time.monotonic()
        alone = start_nodes(free_port(), [[*bound, "--run-dir", str(tmp_path / "alone")], None])
        lost = start_nodes(free_port(), [None, [*bound, "--run-dir", str(tmp_path / "lost")]])
        both = start_nodes(held, [[*bound, "--run-dir", str(tmp_path / "held")]] * 2)
        joined = start_nodes(other_port, [None, [*bound, "--run-dir", str(tmp_path / "joined")]])
        lines = error_lines([*alone, *lost, *both, *joined], timeout=300)
        waited = time.monotonic() - start
    finally:
        holder.close()
        del counted, other_job
    assert lines[0].startswith(
        "error: rank(s) 1 of 2 never arrived at the rendezvous within parallel.rendezvous_timeout_s=8s"
    )
    assert lines[1].startswith("error: nothing answered at 127.0.0.1:") and "(Connection refused)" in lines[1]
    assert lines[2].startswith(f"error: port {held} on node 0 ({socket.gethostname()}) is held by another program")
    assert lines[3].startswith(f"error: 127.0.0.1:{held} accepts connections but is not rank 0's rendezvous")
    assert lines[4].startswith(
        f"error: the rendezvous at 127.0.0.1:{other_port} belongs to another job (it already counts a rank 1)"
    ), lines[4]
    assert waited < 90


def test_ranks_that_read_different_data_at_one_path_stop_naming_it(tmp_path):
    """Two real gloo ranks whose data (node-local copies at one path, say) differ in vocabulary: both stop with
    the same line naming the data's keys and the nodes, where the model each would size from its data would have
    met in a collective of mismatched sizes (gloo's abort on one rank, a wait for the start-up bound on the
    other)."""
    code = (
        "import types, torch.distributed as dist\n"
        "from common.errors import NodesDisagree\n"
        "from pretrain.agreement import agree_on_data\n"
        "from pretrain.distributed import exit_process\n"
        "dist.init_process_group('gloo')\n"
        "vocab = 256 if dist.get_rank() == 0 else 512\n"
        "probe = types.SimpleNamespace(fingerprint=f'manifest-{vocab}', vocab_size=vocab, tokenizer_id='tok')\n"
        "try:\n"
        "    agree_on_data(probe, dist.get_world_size())\n"
        "except NodesDisagree as e:\n"
        "    print('error:', e)\n"
        "    exit_process(2)  # as the trainer ends: interpreter teardown with a live gloo group can abort\n"
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=dict(rank_env(r, 2, port), CROSS_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    lines = error_lines(procs, timeout=120)
    assert lines[0] == lines[1], lines
    said = lines[0]
    host = socket.gethostname()
    assert said.startswith("error: the ranks of this job were not given the same data: "), said
    assert f"the data's vocabulary size: 256 on node 0 ({host}), 512 on node 1 ({host})" in said
    assert f"the data's manifest: manifest-256 on node 0 ({host}), manifest-512 on node 1 ({host})" in said
    assert "tokenizer" not in said.split(". Fix:")[0]  # the same on both: not named
