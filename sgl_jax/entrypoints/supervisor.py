"""The launcher's watch over its replicas (`--dp-size N`; over several nodes each node's
launcher watches its own).

Every `SUPERVISE_INTERVAL_S` the launcher looks at each of its replicas. A replica whose
process exited, or that has not answered `/health` for `--replica-health-timeout` seconds (a
frozen process still accepts connections, so only a missing answer shows it), is killed with
its whole process group and started again with the same flags and port. The router's own
health checks take it out of rotation meanwhile and put it back once `/health` answers, so
the router's list of workers never changes. A replica that fails while starting is started
again after a delay that doubles each time (1, 2, 4 ... 60 s); after `MAX_FAILED_STARTS` starts
in a row that never answered, the launcher says which replica and why, and serves with the
rest.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger("sgl_jax.router")

SUPERVISE_INTERVAL_S = 2
MAX_FAILED_STARTS = 5
MAX_RESTART_DELAY_S = 60
PROBE_TIMEOUT_S = 2  # one /health probe; a frozen replica never answers it


@dataclass
class Replica:
    rank: int
    port: int
    url: str
    process: subprocess.Popen | None  # None while waiting to be started again
    starting: bool = True  # not yet healthy since its last start
    unhealthy_since: float | None = None
    started_at: float = 0.0
    failed_starts: int = 0  # in a row, each ending before /health answered
    restart_at: float = 0.0
    given_up: bool = False


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200 within PROBE_TIMEOUT_S."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=PROBE_TIMEOUT_S) as response:
            return response.status == 200
    except OSError:
        return False


class ReplicaSupervisor:
    """`start(replica) -> Popen` starts a replica's process on `replica.port` in a process
    group of its own. `check()` is one look at every replica."""

    def __init__(self, replicas: Sequence[Replica], start: Callable[[Replica], subprocess.Popen],
                 *, health_timeout: float, start_timeout: float):
        self.replicas = list(replicas)
        self._start = start
        self.health_timeout = health_timeout
        self.start_timeout = start_timeout
        now = time.monotonic()
        for replica in self.replicas:
            replica.started_at = now

    def processes(self) -> list[subprocess.Popen]:
        return [r.process for r in self.replicas if r.process is not None]

    def gave_up_on_all(self) -> bool:
        return all(replica.given_up for replica in self.replicas)

    def check(self) -> None:
        for replica in self.replicas:
            if not replica.given_up:
                self._check(replica, time.monotonic())

    def _check(self, replica: Replica, now: float) -> None:
        if replica.process is None:
            if now >= replica.restart_at:
                self._restart(replica, now)
            return
        code = replica.process.poll()
        if code is None and healthy(replica.url):
            if replica.starting:
                logger.info("Replica %d is serving on port %d", replica.rank, replica.port)
            replica.starting, replica.unhealthy_since, replica.failed_starts = False, None, 0
            return
        if code is not None:
            self._fail(replica, now, f"exited with code {code}")
        elif replica.starting:
            if now - replica.started_at >= self.start_timeout:
                self._fail(replica, now, f"did not answer /health within {self.start_timeout:g} "
                                         "s of starting")
        else:
            replica.unhealthy_since = replica.unhealthy_since or now
            if now - replica.unhealthy_since >= self.health_timeout:
                self._fail(replica, now, f"did not answer /health for "
                                         f"{self.health_timeout:g} s")

    def _fail(self, replica: Replica, now: float, reason: str) -> None:
        kill_group(replica.process)
        replica.process = None
        if replica.starting:
            replica.failed_starts += 1
        if replica.failed_starts >= MAX_FAILED_STARTS:
            replica.given_up = True
            logger.error("Replica %d %s; it failed %d starts in a row and is not started "
                         "again: serving with the other replicas", replica.rank, reason,
                         replica.failed_starts)
            return
        delay = min(2 ** (replica.failed_starts - 1), MAX_RESTART_DELAY_S) \
            if replica.failed_starts else 0
        replica.restart_at = now + delay
        logger.warning("Replica %d %s: starting it again on port %d%s", replica.rank, reason,
                       replica.port, f" in {delay} s" if delay else "")

    def _restart(self, replica: Replica, now: float) -> None:
        replica.process = self._start(replica)
        replica.starting, replica.unhealthy_since, replica.started_at = True, None, now


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's whole group (a replica and anything it started; a stopped
    process dies too) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        logger.error("process %d did not exit after SIGKILL", process.pid)
