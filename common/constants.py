"""Values and helpers shared by several layers, defined once."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IGNORE_INDEX = -100  # a label position that is not scored (torch's cross-entropy default)
DEFAULT_SEED = 1234  # a recipe's seed when it names none: init, data order, a synthetic task's content


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


def fsync_path(path: str | Path) -> None:
    """Flush a file's (or a directory's entries') data to stable storage."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, text: str) -> None:
    """Readers see the old file or the whole new one, also after a power loss: the new text is
    fsynced before the rename, and the directory after it."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


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
