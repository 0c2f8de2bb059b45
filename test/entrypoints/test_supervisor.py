"""The launcher's supervision of `--dp-size` replicas, on real processes: small HTTP servers
that answer /health as a replica does, frozen with SIGSTOP, killed with SIGKILL, or failing at
start. The supervisor must restart a frozen or dead replica on its port, and give up, saying
why, on one that never starts."""

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from sgl_jax.entrypoints import supervisor as supervision
from sgl_jax.entrypoints.router import free_port
from sgl_jax.entrypoints.supervisor import Replica, ReplicaSupervisor

HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def start_health_server(replica: Replica) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HEALTH_SERVER, str(replica.port)],
                            start_new_session=True)


def start_failing(replica: Replica) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                            start_new_session=True)


def supervised(start, **timeouts) -> ReplicaSupervisor:
    port = free_port()
    replica = Replica(0, port, f"http://127.0.0.1:{port}", None)
    supervisor = ReplicaSupervisor([replica], start,
                                   **{"health_timeout": 10, "start_timeout": 30, **timeouts})
    supervisor.check()  # no process yet: the first look starts it
    return supervisor


def check_until(supervisor: ReplicaSupervisor, done, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done(supervisor.replicas[0]):
        assert time.monotonic() < deadline, supervisor.replicas[0]
        supervisor.check()
        time.sleep(0.1)


@pytest.fixture
def serving():
    supervisor = supervised(start_health_server, health_timeout=1.0)
    try:
        check_until(supervisor, lambda r: not r.starting, 30)
        yield supervisor
    finally:
        for process in supervisor.processes():
            supervision.kill_group(process)


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL])
def test_a_frozen_or_dead_replica_is_started_again_on_its_port(serving, fault, caplog):
    replica = serving.replicas[0]
    first = replica.process
    os.kill(first.pid, fault)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sgl_jax.router"):
        check_until(serving, lambda r: r.process is not None and r.process is not first, 15)
    assert first.poll() is not None  # the frozen one was killed, not left behind
    check_until(serving, lambda r: not r.starting, 30)  # serving again, same port
    assert supervision.healthy(replica.url)
    waited = time.monotonic() - began
    # SIGSTOP: health timeout (1 s) plus probes that time out (2 s each); SIGKILL: at once.
    assert waited < (10 if fault == signal.SIGSTOP else 5), waited
    reason = "did not answer /health for 1 s" if fault == signal.SIGSTOP else "exited with code"
    assert f"Replica 0 {reason}" in caplog.text and "starting it again" in caplog.text


def test_a_replica_that_never_starts_is_given_up_after_backed_off_retries(monkeypatch, caplog):
    monkeypatch.setattr(supervision, "MAX_FAILED_STARTS", 3)
    with caplog.at_level(logging.WARNING, logger="sgl_jax.router"):
        supervisor = supervised(start_failing)
        began = time.monotonic()
        check_until(supervisor, lambda r: r.given_up, 20)
    replica = supervisor.replicas[0]
    assert replica.failed_starts == 3 and replica.process is None
    assert time.monotonic() - began >= 1 + 2 - 0.5  # waited 1 s, then 2 s, between starts
    assert "in 1 s" in caplog.text and "in 2 s" in caplog.text
    assert "Replica 0 exited with code 3; it failed 3 starts in a row" in caplog.text
    supervisor.check()
    assert replica.process is None  # given up: never started again
