"""Values and helpers shared by several layers, defined once."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IGNORE_INDEX = -100  # a label position that is not scored (torch's cross-entropy default)


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
