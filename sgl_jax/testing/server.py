"""Run `python -m sgl_jax.launch_server` in a subprocess for tests, examples and benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

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
                  env: dict[str, str] | None = None,
                  launcher: tuple[str, ...] = ("-m", "sgl_jax.launch_server")
                  ) -> Iterator[ServerProcess]:
    """Start the server with `args` (--port is added) and wait until /health answers; stop
    it on exit. Its output goes to a log file, shown if it dies while starting. `launcher`:
    what the Python interpreter runs (a script that wraps launch_server.main, say)."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="sgl-jax-server-", suffix=".log")[1])
    command = [sys.executable, *launcher, *args, "--host", "127.0.0.1", "--port", str(port)]
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


class StreamedChat(threading.Thread):
    """One streamed chat of `max_tokens` (ignore_eos) on its own thread; `chunks` read so far,
    `ending`: "done" ([DONE] came), "error" (an error event in OpenAI's shape came, kept in
    `error`) or "cut" (the stream closed without either)."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.chunks, self.ending, self.error = 0, "cut", None

    def run(self) -> None:
        body = {"model": "default", "messages": [{"role": "user", "content": "tell a story"}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self._read(line.removeprefix("data: "))
        except httpx.HTTPError:  # the stream broke off: "cut" unless it had ended already
            pass

    def _read(self, data: str) -> None:
        if data == "[DONE]":
            self.ending = "done"
            return
        event = json.loads(data)
        if "error" in event:
            self.error = event["error"]
            self.ending = "error"
        else:
            self.chunks += 1
