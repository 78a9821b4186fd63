"""Stop a rank whose launcher is gone, through the trainer's SIGTERM path (checkpoint, then exit).

Why: SIGKILL to launch.sh's process group (an OOM kill, a lost login shell) kills only the shell;
DeepSpeed's runner and the ranks, in a process group of their own, would train on, holding devices
and writing into a run dir that a restarted job owns. A rank sends itself SIGTERM when
* its parent (DeepSpeed's launch.py, torchrun, slurmstepd) dies: PR_SET_PDEATHSIG on Linux, a poll of
  the parent PID elsewhere; launched ranks only (LOCAL_RANK set), so a plain `nohup python -m
  pretrain.train` survives its shell;
* the launch.sh that started the job, or the study that started the run (studies/scaling/runs.py), dies:
  it exports LAUNCHER_ENV="HOST PID", polled on that host only.
The per-step all-reduce of the stop flag makes every rank stop when one notices.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

LAUNCHER_ENV = "PRETRAIN_LAUNCHER"
PR_SET_PDEATHSIG = 1
POLL_S = 1.0


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), so a reused PID is not mistaken for it;
    "" where /proc does not exist but the PID is alive; None when no such process exists (or it is a
    zombie: killed, not yet reaped by its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def _parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _launcher_pid() -> int | None:
    """The launcher's PID (launch.sh, a study) from LAUNCHER_ENV when it was started on this host."""
    host, _, pid = os.environ.get(LAUNCHER_ENV, "").strip().rpartition(" ")
    if not pid.isdigit() or host != socket.gethostname():
        return None
    return int(pid)


def _stop(reason: str) -> None:
    try:
        print(
            f"[rank {os.environ.get('RANK', '?')}] {reason}: stopping (SIGTERM: checkpoint, then exit)",
            file=sys.stderr,
            flush=True,
        )
    except OSError:  # the terminal went with the launcher
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _watch(launcher: int | None, launcher_start: str | None, parent: int | None, poll_s: float) -> None:
    while True:
        if launcher is not None and _start_time(launcher) != launcher_start:
            return _stop(f"launcher (pid {launcher}) is gone")
        if parent is not None and os.getppid() != parent:
            return _stop(f"parent process {parent} is gone")
        time.sleep(poll_s)


def stop_when_launcher_dies(poll_s: float = POLL_S) -> threading.Thread | None:
    """Arrange for SIGTERM to this process when its launcher dies; returns the watchdog thread, if any."""
    launched = "LOCAL_RANK" in os.environ
    by_kernel = launched and _parent_death_signal(signal.SIGTERM)
    launcher = _launcher_pid()
    parent = os.getppid() if launched and not by_kernel else None
    if launcher is None and parent is None:
        return None
    start = _start_time(launcher) if launcher is not None else None
    if launcher is not None and start is None:
        _stop(f"launcher (pid {launcher}) is gone")
        return None
    thread = threading.Thread(
        target=_watch, args=(launcher, start, parent, poll_s), name="orphan-watchdog", daemon=True
    )
    thread.start()
    return thread
