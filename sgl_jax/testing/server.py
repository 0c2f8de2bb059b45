"""Run `python -m sgl_jax.launch_server` in a subprocess for tests, examples and benchmarks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_jax.entrypoints.router import free_port


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


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


# The demo pair's servers in the slow OpenAI tests: small limits, the seed cards' tree.
DEMO_FLAGS = ["--skip-server-warmup", "--max-running-requests", "16", "--context-length", "1024",
              "--served-model-name", "demo"]
DEMO_SPEC_FLAGS = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                   "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]


@contextlib.contextmanager
def demo_servers(extra_flags: list[str] = ()) -> Iterator[dict[str, ServerProcess]]:
    """{"plain": the demo model's server, "spec": the same with its EAGLE3 head}, both with
    DEMO_FLAGS and `extra_flags`; the test is skipped when the demo model is not installed."""
    import pytest

    from sgl_jax.demo import demo_model_path

    try:
        demo_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"demo model not installed: {e}")
    flags = [*DEMO_FLAGS, *extra_flags]
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(launch_server(flags))
        # As README.md starts it: without a draft path the demo serves its own head.
        spec = stack.enter_context(launch_server([*flags, *DEMO_SPEC_FLAGS]))
        yield {"plain": plain, "spec": spec}


def openai_client(server: ServerProcess) -> Any:
    """The official openai client for `server`, without retries."""
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


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
