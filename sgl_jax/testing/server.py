"""Run `python -m sgl_jax.launch_server` in a subprocess for tests, examples and benchmarks."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launch_server(args: list[str], *, timeout_s: float = 300,
                  env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """Start the server with `args` (--port is added) and wait until /health answers; stop
    it on exit. Its output goes to a log file, shown if it dies while starting."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="sgl-jax-server-", suffix=".log")[1])
    command = [sys.executable, "-m", "sgl_jax.launch_server", *args, "--host", "127.0.0.1",
               "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_healthy(server, timeout_s)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_healthy(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}:\n"
                               f"{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.base_url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the server did not become healthy in {timeout_s} s:\n{server.log()}")
