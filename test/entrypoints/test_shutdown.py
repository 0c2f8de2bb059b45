"""SIGTERM under load: a server stops taking requests, lets the running ones finish within
--shutdown-drain-s, ends the rest with an error event and exits, while a background build
that never ends is running (a wrapper holds one open, as a long compile would)."""

import re
import signal
import time

import httpx
import pytest

from sgl_jax.testing import write_tiny_checkpoint
from sgl_jax.testing.server import StreamedChat, launch_server

DRAIN_S = 2
# What exiting may take beyond the drain window: the aborts' last events, closing the
# connections, the engine's shutdown (a running build is abandoned after 1 s).
EXIT_GRACE_S = 8
FLAGS = ["--dtype", "float32", "--precompile-token-paddings", "64,256",
         "--precompile-bs-paddings", "1,4,8", "--max-prefill-tokens", "256",
         "--context-length", "4096", "--shutdown-drain-s", str(DRAIN_S)]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
# Runs the launcher with one more background build, started after the others and never
# finished: the server is stopped while it runs.
HOLDING_LAUNCHER = '''
import sys, threading
from sgl_jax import launch_server
from sgl_jax.model_executor import programs

resume = programs.BackgroundBuilder.resume


def hold(self):
    def never_ends():
        print("holding a background build", flush=True)
        threading.Event().wait()
    self.submit("held build", never_ends, priority=10**9)
    resume(self)


programs.BackgroundBuilder.resume = hold
sys.exit(launch_server.main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.1)


def test_sigterm_drains_then_aborts_and_exits_while_a_build_runs(model_dir, tmp_path):
    script = tmp_path / "holding_launcher.py"
    script.write_text(HOLDING_LAUNCHER)
    with launch_server(["--model-path", str(model_dir), *FLAGS],
                       launcher=(str(script),)) as server:
        short = [StreamedChat(server.base_url, 4) for _ in range(2)]
        long = [StreamedChat(server.base_url, 3000) for _ in range(6)]
        for stream in short + long:
            stream.start()
        wait_for(lambda: all(stream.chunks > 0 for stream in long), 120)
        wait_for(lambda: "holding a background build" in server.log(), 120)
        kept = httpx.Client(base_url=server.base_url, timeout=5)
        assert kept.get("/health").status_code == 200  # a connection kept alive
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no new connection is taken...
            httpx.post(f"{server.base_url}/v1/chat/completions", timeout=5, json=CHAT)
        for path, body in (("/v1/chat/completions", CHAT), ("/generate", {"text": "hi"})):
            refused = kept.post(path, json=body)  # ...nor a request on an open one
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "unavailable", refused.text
        kept.close()
        server.process.wait(timeout=DRAIN_S + EXIT_GRACE_S + 10)
        exited_after = time.monotonic() - signalled
        for stream in short + long:
            stream.join(timeout=10)
        log = server.log()
    assert exited_after <= DRAIN_S + EXIT_GRACE_S, exited_after
    assert [stream.ending for stream in short] == ["done", "done"]
    assert [stream.ending for stream in long] == ["error"] * len(long)
    for stream in long:
        assert stream.error["code"] == "aborted", stream.error
        assert "shutting down" in stream.error["message"], stream.error
    assert "Traceback" not in log, log
    assert re.search(r"Aborted 6 requests still running after \d+ s", log), log
