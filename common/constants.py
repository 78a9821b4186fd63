"""Values and helpers shared by several layers, defined once."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IGNORE_INDEX = -100  # a label position that is not scored (torch's cross-entropy default)


def repo_path(p: str | Path) -> Path:
    """`p`, or for a relative `p` not found from here, the same path in the repository if it is there."""
    path = Path(p)
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        return REPO_ROOT / path
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a test server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def file_sha256(path: str | Path, h=None):
    """`h` (default: a new sha256) updated with the bytes of the file at `path`, read in 4 MiB blocks."""
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h


def free_space(path: str | Path) -> str:
    """The space free to this user on `path`'s filesystem, in human units ("unknown" if it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return "unknown"
    n = st.f_bavail * st.f_frsize
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "unknown"
