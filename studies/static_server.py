"""A shard directory served over HTTP from a process of its own, on loopback, which can be stopped
and started again on the same port: the long chaos run's data server, the remote-data tests' and the
loader benchmark's.

The server process is `python -m aiohttp.web -H 127.0.0.1 -P PORT studies.static_server:http_app
ROOT` (Range requests included). This module imports only aiohttp and the standard library, so a
restarted server listens within a fraction of a second: an outage test times the restart.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from aiohttp import web

from common.constants import REPO_ROOT, free_port


def http_app(argv: list[str]) -> web.Application:
    """Serve the directory argv[0]."""
    app = web.Application()
    app.router.add_static("/", argv[0], show_index=True)
    return app


class LoopbackServer:
    """A server process on 127.0.0.1 (started at once) that can be stopped and started again on the
    same port. Its output goes to `log` (appended), else to a temporary file: a pipe nobody reads
    would fill up and stall the server."""

    def __init__(
        self,
        cmd_for_port: Callable[[int], list[str]],
        port: int | None = None,
        env: dict | None = None,
        log: Path | None = None,
    ):
        self._cmd_for_port = cmd_for_port
        self.port = port or free_port()
        self.env, self.log = env, log
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        env = dict(os.environ, **(self.env or {}))
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        self._out = open(self.log, "ab") if self.log else tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self._cmd_for_port(self.port), env=env, stdout=self._out, stderr=self._out)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if (code := self.proc.poll()) is not None:
                tail = self._tail()
                self.stop()
                raise RuntimeError(f"server {self._cmd_for_port(self.port)} exited with {code}: {tail}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server {self._cmd_for_port(self.port)} did not listen on port {self.port} in {timeout}s")

    def _tail(self) -> str:
        if self.log:
            return f"see {self.log}"
        self._out.seek(0)
        return self._out.read().decode(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None:
            self._out.close()
        self.proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def http_server(root: str | Path, port: int | None = None, log: Path | None = None) -> LoopbackServer:
    """Serve the directory `root` over HTTP (with Range support) from a separate process."""
    app = [f"{__name__}:http_app", str(root)]
    return LoopbackServer(
        lambda p: [sys.executable, "-m", "aiohttp.web", "-H", "127.0.0.1", "-P", str(p), *app], port, log=log
    )
