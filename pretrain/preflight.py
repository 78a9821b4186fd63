"""Before a multi-node job: check every node the way the job will use it, and name what to fix.

    python -m pretrain.preflight --hostfile FILE [--gpus N | --cpu] [--master-addr A] [--master-port P]
                                 [--iface NAME] --recipe R [--run-dir DIR] [section.key=value ...]
    python -m pretrain.preflight [the same, without --hostfile] inside a Slurm allocation (nodes from SLURM_*)

Run it where launch.sh runs, on the first node, with launch.sh's options and the training arguments. It
reaches each node as the launch does (ssh, as DeepSpeed's runner; srun inside Slurm), runs
`python -m pretrain.preflight --probe` there from this checkout's path with this interpreter, and compares
the answers. It prints one table, then the first failing check as one `error: ... Fix: ...` line (exit 2).
The checks, in this order, are docs/TRAINING.md's "First multi-node job" checklist.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from common.cli import CliParser, run_cli
from common.constants import REPO_ROOT
from common.errors import PreflightError
from eval.report import markdown_table
from model.transformer import Transformer

from .agreement import commit, versions
from .config import load_recipe
from .dry_run import resolve_model
from .run_dir import default_run_dir

CHECKS = ("reached", "commit", "environment", "run dir", "gpus", "disk", "port", "interface")
TAG = "PREFLIGHT "  # a probe's answer line; a login banner or srun's own lines around it are ignored


# ---- on each node ------------------------------------------------------------------------------


def visible_gpus() -> int:
    """The GPUs this node shows, counted as launch.sh counts them: nvidia-smi -L, narrowed by CUDA_VISIBLE_DEVICES."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    seen = sum(line.startswith("GPU ") for line in listed.splitlines())
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        seen = min(seen, len([d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d]))
    return seen


def mark_name(token: str, node: str) -> str:
    """The run-dir file a node leaves (the first node's when `node` is ""), one name per node."""
    return f".preflight-{token}" + (f".{re.sub(r'[^A-Za-z0-9_.-]', '_', node)}" if node else "")


def probe(a: argparse.Namespace) -> dict:
    """This node's answer: its checkout and versions, whether it sees the first node's mark in the run dir and
    can write there, free space, GPUs, whether it reaches the rendezvous port, its interfaces."""
    node = a.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    run_dir, out = Path(a.run_dir), {"node": node, "commit": commit(), "env": versions(), "gpus": visible_gpus()}
    try:
        out["shared"] = (run_dir / mark_name(a.token, "")).read_text() == a.token
    except OSError:
        out["shared"] = False
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # what mkdir creates, deepest first
    mark = run_dir / mark_name(a.token, node)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        mark.write_text(node)
        out["write"] = ""
    except OSError as e:
        out["write"] = f"{type(e).__name__}: {e.strerror or e}"
    where = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    out["free"] = shutil.disk_usage(where).free
    if not out["shared"]:  # a dir the first node does not see: it cannot remove this node's mark, so this node does
        with contextlib.suppress(OSError):
            mark.unlink(missing_ok=True)
            for d in made:
                d.rmdir()
    try:
        socket.create_connection((a.master_addr, a.master_port), timeout=10).close()
        out["port"] = ""
    except OSError as e:
        out["port"] = str(e.strerror or e)
    out["ifaces"] = sorted(name for _, name in socket.if_nameindex())
    return out


# ---- on the first node -----------------------------------------------------------------------------


def checkpoint_bytes(cfg) -> int:
    """About one checkpoint of the recipe's model: every weight in its precision, then fp32 master weights
    and two Adam moments per trainable parameter, and the frozen tensors' own file."""
    mcfg, _ = resolve_model(cfg)
    with torch.device("meta"):
        params = list(Transformer(mcfg).parameters())
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    wb = 2 if cfg.train.precision == "bf16" else 4
    return total * wb + trainable * 12 + (total - trainable) * wb


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """DeepSpeed's hostfile: one `HOST slots=N` per node; `#` comments and blank lines skipped."""
    hosts: list[tuple[str, int]] = []
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#")[0].strip()
        m = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if line and (not m or m[1] in dict(hosts)):
            why = "a host listed twice" if m else "not 'HOST slots=N'"
            raise PreflightError(f"{path}:{n}: '{line}' is {why}. Fix: one 'HOST slots=GPUS' line per node")
        hosts += [(m[1], int(m[2]))] if line else []
    if not hosts:
        raise PreflightError(f"{path} lists no node. Fix: one 'HOST slots=GPUS' line per node")
    return hosts


def slurm_nodes() -> list[tuple[str, int]]:
    """The allocation's nodes and the ranks launch.sh --slurm would put on each (its GPUs, else its tasks)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    listed = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    per = os.environ.get("SLURM_GPUS_ON_NODE") or os.environ.get("SLURM_GPUS_PER_NODE", "").split(":")[-1]
    per = per or os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "0")
    per = int(re.match(r"\d*", per)[0] or 0) or None  # None: Slurm does not say, nothing to compare
    if listed.returncode or not listed.stdout.split():
        raise PreflightError(
            f"scontrol cannot list SLURM_JOB_NODELIST ({listed.stderr.strip()}). Fix: run inside the job"
        )
    return [(host, per) for host in listed.stdout.split()]


def serve(listener: socket.socket) -> None:
    """Accept and close connections until the listener is closed (the probes only check they get through)."""
    with contextlib.suppress(OSError):
        while True:
            listener.accept()[0].close()


def ask(cmd: list[str]) -> tuple[list[dict], str]:
    """Run a probe command; its answers, and the reason when there are none."""
    try:
        r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return [], "no answer in 300 s"
    except OSError as e:  # no ssh or srun on this node
        return [], f"cannot run {cmd[0]}: {e.strerror or e}"
    answers = [json.loads(line[len(TAG) :]) for line in r.stdout.splitlines() if line.startswith(TAG)]
    last = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
    return answers, last[:300]


FIX = {  # what to do when a check fails, by check
    "reached": "passwordless ssh from this node (ssh {host} true; DeepSpeed's runner needs it too) or, under Slurm, "
    "a healthy node (sinfo -N), with this checkout at {repo} and {python} there",
    "commit": "the same checkout on every node (one commit, the same edits), or the repository on a shared filesystem",
    "environment": "the same environment on every node (scripts/bootstrap.sh from the same PYTHON and wheelhouse, "
    "or one .venv on a shared filesystem)",
    "run dir": "a --run-dir on a filesystem every node mounts at the same path, writable by this user",
    "gpus": "as many ranks on a node as it has GPUs: the hostfile's slots or --gpus (Slurm: --ntasks-per-node and "
    "--gpus-per-node), or CUDA_VISIBLE_DEVICES",
    "disk": "free space there, or a --run-dir on a larger filesystem",
    "port": "run preflight and launch.sh on the first node, with a --master-addr every node reaches and TCP open "
    "between the nodes (firewall), or another --master-port",
    "interface": "--iface with a name every node has (ip -br link)",
}


@dataclass
class Plan:
    """What the job will use: where it writes, how much, and where rank 0 listens."""

    run_dir: Path
    token: str  # the first node's mark in the run dir
    need: int  # bytes of one checkpoint
    addr: str
    port: int
    iface: str


def verdicts(a: dict, first: dict, ranks: int | None, plan: Plan) -> list[tuple[str, str]]:
    """(table cell, problem or "") of each check after "reached", for one node's answer `a`."""
    env, ref, gib = a["env"], first["env"], 2**30
    differs = ", ".join(f"{k} {env[k]} where {first['node']} has {ref[k]}" for k in ref if env.get(k) != ref[k])
    seen = (plan.run_dir / mark_name(plan.token, a["node"])).is_file()  # what the node wrote, seen here
    shared = not a["write"] and a["shared"] and seen
    unshared = (
        f"cannot write to {plan.run_dir} ({a['write']})"
        if a["write"]
        else (
            f"does not share {plan.run_dir} with this node (a mark written on one is not seen on the other), so the "
            "nodes would write checkpoints and decide where to resume apart"
        )
    )
    gpus = str(a["gpus"]) + ("" if ranks is None else f"/{ranks}")
    return [
        (a["commit"], a["commit"] != first["commit"] and f"runs {a['commit']}, {first['node']} {first['commit']}"),
        (" ".join(f"{k} {v}" for k, v in env.items()), differs and f"has {differs}"),
        ("shared" if shared else "not shared", not shared and unshared),
        (gpus, ranks not in (None, a["gpus"]) and f"shows {a['gpus']} GPU(s) but the job starts {ranks} rank(s) there"),
        (
            f"{a['free'] / gib:.1f} GiB free",
            a["free"] < plan.need
            and f"has {a['free'] / gib:.1f} GiB free under "
            f"{plan.run_dir}; one checkpoint of this recipe takes about {plan.need / gib:.1f} GiB",
        ),
        (
            "ok" if not a["port"] else "no",
            a["port"] and f"cannot connect to {plan.addr}:{plan.port} ({a['port']}), where rank 0 will listen",
        ),
        (
            plan.iface or "-",
            plan.iface not in ("", *a["ifaces"]) and f"has no interface {plan.iface} (it has {', '.join(a['ifaces'])})",
        ),
    ]


def judge(nodes: list[tuple[str, int | None]], answers: list[dict | str], plan: Plan):
    """Each node's table row, and the first failure in checklist order (then node order) as an error message."""
    first = next((a for a in answers if isinstance(a, dict)), {})
    rows, failures = [], []
    for i, ((host, ranks), a) in enumerate(zip(nodes, answers)):
        if isinstance(a, dict):
            found = [("yes", ""), *verdicts(a, first, ranks, plan)]
        else:
            found = [("no", f"did not answer ({a})")] + [("-", "")] * (len(CHECKS) - 1)
        rows.append([host, *(f"{cell} (!)" if problem else cell for cell, problem in found)])
        fix = {"host": host, "repo": REPO_ROOT, "python": sys.executable}
        for j, (_, problem) in enumerate(found):
            if problem:
                failures.append((j, i, f"{CHECKS[j]}: {host} {problem}. Fix: {FIX[CHECKS[j]].format(**fix)}"))
    return rows, (min(failures)[2] if failures else None)


def listen(port: int) -> socket.socket:
    """Rank 0's side of the rendezvous, on this node as under launch.sh: a listening socket on `port` (0: any
    free one, as launch.sh picks it) that accepts and drops the probes' connections until it is closed."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore: not refused by TIME_WAIT
    try:
        listener.bind(("", port))
    except OSError as e:
        raise PreflightError(
            f"port {port} is not free on this node ({e.strerror}), where rank 0 would listen. "
            "Fix: another --master-port (launch.sh takes the same), or end what holds it"
        ) from None
    listener.listen(64)
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
    return listener


def probe_all(nodes: list[tuple[str, int | None]], cmd: list[str], slurm: bool) -> list[dict | str]:
    """Every node's answer to the probe `cmd` (or why it gave none): one srun task per node inside Slurm, else
    ssh to each node at once, from this checkout's path as DeepSpeed's runner starts its ranks."""
    if slurm:
        n = str(len(nodes))
        found, why = ask(["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--kill-on-bad-exit=0", *cmd])
        by_node = {x["node"]: x for x in found}
        return [by_node.get(host, f"no answer through srun: {why}") for host, _ in nodes]

    def over_ssh(host: str) -> dict | str:
        remote = f"cd {shlex.quote(str(REPO_ROOT))} && {shlex.join([*cmd, '--node', host])}"
        found, why = ask(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, remote])
        return found[0] if found else why

    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        return list(pool.map(over_ssh, [host for host, _ in nodes]))


def preflight(a: argparse.Namespace) -> int:
    cfg = load_recipe(a.recipe, a.overrides)
    slurm = not a.hostfile
    if slurm and not os.environ.get("SLURM_JOB_ID"):
        raise PreflightError("no --hostfile and not inside a Slurm allocation. Fix: --hostfile FILE, as launch.sh")
    nodes = [
        (host, None if a.cpu else (a.gpus or n)) for host, n in (slurm_nodes() if slurm else read_hostfile(a.hostfile))
    ]
    run_dir = Path(a.run_dir) if a.run_dir else default_run_dir(cfg)
    run_dir = run_dir if run_dir.is_absolute() else REPO_ROOT / run_dir  # launch.sh starts the ranks there
    named = [v for v in (os.environ.get("NCCL_SOCKET_IFNAME"), os.environ.get("GLOO_SOCKET_IFNAME")) if v]
    iface = a.iface or next((v for v in named if not v.startswith(("^", "="))), "")  # NCCL's ^/= are not names
    port = a.master_port or (20000 + int(os.environ["SLURM_JOB_ID"]) % 10000 if slurm else 0)  # launch.sh's
    listener = listen(port)
    plan = Plan(run_dir, uuid.uuid4().hex, checkpoint_bytes(cfg), a.master_addr or nodes[0][0], 0, iface)
    plan.port = listener.getsockname()[1]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / mark_name(plan.token, "")).write_text(plan.token)
    cmd = [sys.executable, "-m", "pretrain.preflight", "--probe", "--run-dir", str(run_dir), "--token", plan.token]
    try:
        answers = probe_all(nodes, [*cmd, "--master-addr", plan.addr, "--master-port", str(plan.port)], slurm)
        rows, error = judge(nodes, answers, plan)
    finally:
        listener.close()
        for mark in run_dir.glob(mark_name(plan.token, "") + "*"):
            mark.unlink(missing_ok=True)
    print(markdown_table(["node", *CHECKS], rows))
    if error:
        raise PreflightError(error)
    print(
        f"preflight: {len(nodes)} node(s) ready for {cfg.name} (run dir {run_dir}, rendezvous {plan.addr}:{plan.port})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m pretrain.preflight", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hostfile", help="DeepSpeed's hostfile ('HOST slots=GPUS'); without it, the Slurm allocation")
    ap.add_argument("--gpus", type=int, help="ranks per node (launch.sh --gpus); default: each host's slots")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks: no GPU count to check")
    ap.add_argument("--master-addr", help="rendezvous address (default: the first node)")
    ap.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: as launch.sh picks it)")
    ap.add_argument("--iface", help="interface the ranks talk over (launch.sh --iface)")
    ap.add_argument("--recipe", help="the job's recipe (for the run dir and the checkpoint size)")
    ap.add_argument("--run-dir", help="the job's --run-dir (default: runs/<name>)")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--token", help=argparse.SUPPRESS)
    ap.add_argument("--node", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    a = ap.parse_intermixed_args(argv)
    if a.probe:
        print(TAG + json.dumps(probe(a)), flush=True)
        return 0
    if not a.recipe:
        ap.error("--recipe is required (the job's recipe: its run dir and checkpoint size)")
    return run_cli(lambda: preflight(a))


if __name__ == "__main__":
    sys.exit(main())
