"""`--dp-size N`: N replicas of the server behind SGLang's router, from one command.

Each replica is a whole server (`python -m sgl_jax.launch_server` with the same flags) in its
own process on its own `--tp-size` devices, listening on a free local port; SGLang's router
(`sglang-router`, the optional extra `sgl-jax[router]`) serves `--host`/`--port` in front of
them, with its routing policy, health checks and retries. The launcher stops every process
when it is stopped or when the router exits. On rank 0 it also watches its replicas: one that
exits or stops answering `/health` is killed and started again on its port
(sgl_jax.entrypoints.supervisor), while the router routes around it.

Over `--nnodes M`, each node's launcher (the same command with its own `--node-rank`) starts
N / M replicas on that node's devices; the other ranks report their replicas' addresses to
rank 0 at `--dist-init-addr`, whose router serves them all, and stop theirs when rank 0 stops.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from sgl_jax.entrypoints.supervisor import (
    SUPERVISE_INTERVAL_S,
    Replica,
    ReplicaSupervisor,
    healthy,
)
from sgl_jax.parallel.multihost import connect_when_listening
from sgl_jax.server_args import ServerArgs

logger = logging.getLogger("sgl_jax.router")

ROUTER_EXTRA = 'pip install "sgl-jax[router]"'
# The router's own flags the launcher passes on, as the router names them (the launcher's
# are --router-NAME, as sglang_router.launch_server names them).
ROUTER_SETTINGS = ("request-timeout-secs", "retry-max-retries", "health-failure-threshold",
                   "health-check-timeout-secs", "cb-timeout-duration-secs")
# Flags the launcher answers itself; each replica (one node's) gets the rest unchanged.
_LAUNCHER_FLAGS = {"--dp-size": True, "--dp": True, "--router-policy": True, "--port": True,
                   "--host": True, "--nnodes": True, "--node-rank": True,
                   "--dist-init-addr": True, "--replica-health-timeout": True,
                   **{f"--router-{name}": True for name in ROUTER_SETTINGS}}  # takes a value
REPLICA_START_TIMEOUT_S = 1800  # a large model's load and warm-up
# Seconds a stopping process may take beyond a replica's drain window (aborting what is left,
# closing its connections, exiting) before it is killed.
STOP_GRACE_S = 10
# The router checks each replica this often, so a dead one leaves the rotation in seconds.
HEALTH_CHECK_INTERVAL_S = 2


def serve_replicas(args: ServerArgs, argv: Sequence[str]) -> int:
    """Start this node's share of args.dp_size replicas; rank 0 also starts the router in
    front of every node's replicas. Runs until stopped; returns an exit code."""
    if args.node_rank == 0:
        _require_router()
    device_envs = replica_device_envs(args)
    first = args.node_rank * len(device_envs)
    with _Meeting(args) as meeting:
        replicas = [_start_replica(argv, env, first + i, meeting.bind_host,
                                   meeting.advertised_host)
                    for i, env in enumerate(device_envs)]
        router, supervisor = None, None
        _stop_on_signals()
        try:
            _wait_healthy(replicas)
            # Every node's launcher supervises its own replicas, on the ports the router has.
            supervisor = ReplicaSupervisor(
                [Replica(first + i, _port_of(url), url, process)
                 for i, (process, url) in enumerate(replicas)],
                lambda replica: _start_replica(argv, device_envs[replica.rank - first],
                                               replica.rank, meeting.bind_host,
                                               meeting.advertised_host, replica.port)[0],
                health_timeout=args.replica_health_timeout,
                start_timeout=REPLICA_START_TIMEOUT_S)
            local_urls = [url for _, url in replicas]
            if args.node_rank > 0:
                meeting.report(local_urls)
                return meeting.wait_for_rank_0(supervisor)
            urls = local_urls + meeting.gather()
            router = subprocess.Popen(router_command(args, urls), start_new_session=True)
            logger.info("Serving %d replicas (%s) behind SGLang's router on http://%s:%d",
                        len(urls), ", ".join(urls), args.host, args.port)
            while router.poll() is None:
                supervisor.check()
                time.sleep(SUPERVISE_INTERVAL_S)
            return router.returncode
        except _Stopped:
            return 0
        finally:
            # The replicas drain first, behind the router still running, so their streams
            # end through it with their last chunks or error events.
            _terminate(supervisor.processes() if supervisor else
                       [process for process, _ in replicas],
                       args.shutdown_drain_s + STOP_GRACE_S)
            _terminate([router] if router else [], STOP_GRACE_S)


class _Meeting:
    """How the launchers of --nnodes > 1 find each other: rank 0 listens on
    --dist-init-addr's port; every other rank connects, sends its replicas' URLs as one JSON
    line and keeps the connection open. Rank 0 closing it (its router exited or it was
    stopped) stops the other ranks' replicas. With one node there is nothing to meet."""

    def __init__(self, args: ServerArgs):
        self.nnodes, self.node_rank = args.nnodes, args.node_rank
        self.connections: list[socket.socket] = []
        self.listener: socket.socket | None = None
        if self.nnodes == 1:
            self.bind_host = self.advertised_host = "127.0.0.1"
            return
        host, _, port = args.dist_init_addr.rpartition(":")
        self.rank_0 = (host.strip("[]"), int(port))
        # Replicas of a multi-node launch serve the router on another host.
        self.bind_host, self.advertised_host = "0.0.0.0", _address_towards(self.rank_0)
        if self.node_rank == 0:
            self.listener = socket.create_server(("", self.rank_0[1]))
            self.listener.settimeout(REPLICA_START_TIMEOUT_S)

    def __enter__(self) -> _Meeting:
        return self

    def __exit__(self, *exc) -> None:
        for sock in [*self.connections, *([self.listener] if self.listener else [])]:
            sock.close()

    def gather(self) -> list[str]:
        """Rank 0: the replica URLs every other rank reports, in rank order."""
        reports: dict[int, list[str]] = {}
        while len(reports) < self.nnodes - 1:
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                raise ValueError(f"only nodes {sorted(reports)} of 1..{self.nnodes - 1} "
                                 f"reported their replicas in {REPLICA_START_TIMEOUT_S} s"
                                 ) from None
            self.connections.append(connection)
            report = json.loads(connection.makefile().readline())
            reports[report["node_rank"]] = report["urls"]
            logger.info("Node %d serves replicas %s", report["node_rank"],
                        ", ".join(report["urls"]))
        return [url for rank in sorted(reports) for url in reports[rank]]

    def report(self, urls: list[str]) -> None:
        """Rank > 0: send this node's replica URLs to rank 0, which may not listen yet."""
        connection = connect_when_listening(self.rank_0, REPLICA_START_TIMEOUT_S,
                                            "rank 0's launcher")
        connection.sendall((json.dumps({"node_rank": self.node_rank, "urls": urls}) + "\n"
                            ).encode())
        self.connections.append(connection)

    def wait_for_rank_0(self, supervisor: ReplicaSupervisor) -> int:
        """Rank > 0: supervise this node's replicas until rank 0 hangs up (0) or the
        supervisor gave up on every one (1)."""
        connection = self.connections[0]
        connection.settimeout(SUPERVISE_INTERVAL_S)
        while not supervisor.gave_up_on_all():
            try:
                if not connection.recv(1):
                    logger.info("Rank 0 hung up: stopping this node's replicas")
                    return 0
            except TimeoutError:
                supervisor.check()
            except OSError:  # rank 0's host went away
                logger.info("Lost rank 0: stopping this node's replicas")
                return 0
        return 1


def _address_towards(peer: tuple[str, int]) -> str:
    """This host's address on the route to `peer` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(peer)
        return probe.getsockname()[0]


def _require_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError(f"--dp-size needs SGLang's router, which is not installed: "
                         f"{ROUTER_EXTRA}")


def replica_device_envs(args: ServerArgs) -> list[dict[str, str]]:
    """Environment overrides giving each replica its own tp_size devices (GPU); on the CPU
    the replicas share the host."""
    local = args.dp_size // args.nnodes  # this node's share of the replicas
    device = args.device or ("gpu" if _visible_gpus() else "cpu")
    if device == "cpu":
        return [{} for _ in range(local)]
    if device == "tpu":
        raise NotImplementedError(
            "--dp-size on TPU is not supported: start one server per chip group "
            "(TPU_VISIBLE_CHIPS) and SGLang's router in front of them (docs/parallel.md)")
    gpus = _visible_gpus()
    needed = local * args.tp_size
    if needed > len(gpus):
        per_node = f" per node ({args.nnodes} nodes)" if args.nnodes > 1 else ""
        raise ValueError(f"--dp-size {args.dp_size} x --tp-size {args.tp_size} needs {needed} "
                         f"GPUs{per_node}, {len(gpus)} visible")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * args.tp_size: (i + 1) * args.tp_size])}
            for i in range(local)]


def _visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES, else those nvidia-smi lists."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return [str(i) for i, line in enumerate(listing.stdout.splitlines())
            if line.startswith("GPU ")]


def replica_argv(argv: Sequence[str]) -> list[str]:
    """The command line without the flags the launcher answers itself."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _LAUNCHER_FLAGS:
            skip = _LAUNCHER_FLAGS[name] and "=" not in arg
            continue
        kept.append(arg)
    return kept


def router_command(args: ServerArgs, urls: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            "--policy", args.router_policy, "--host", args.host, "--port", str(args.port),
            "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
            *(flag for name in ROUTER_SETTINGS for flag in (
                f"--{name}", str(getattr(args, "router_" + name.replace("-", "_"))))),
            # its metrics port is fixed otherwise, and a second router on the host fails
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warn" if args.log_level in ("warning", "error") else "info"]


def _start_replica(argv: Sequence[str], env: dict[str, str], rank: int, bind_host: str,
                   advertised_host: str, port: int | None = None
                   ) -> tuple[subprocess.Popen, str]:
    """A replica on `port` (default: a free one), in a process group of its own."""
    port = port or free_port()
    command = [sys.executable, "-m", "sgl_jax.launch_server", *replica_argv(argv),
               "--host", bind_host, "--port", str(port)]
    logger.info("Starting replica %d on port %d%s", rank, port,
                f" ({env})" if env else "")
    # Its own process group: Ctrl+C reaches the launcher, which stops replicas in order.
    process = subprocess.Popen(command, env={**os.environ, **env}, start_new_session=True)
    logger.info("Replica %d is process %d", rank, process.pid)
    return process, f"http://{advertised_host}:{port}"


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(replicas: Sequence[tuple[subprocess.Popen, str]]) -> None:
    deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
    for rank, (process, url) in enumerate(replicas):
        while not healthy(url):
            if process.poll() is not None:
                raise ValueError(f"replica {rank} exited with code {process.returncode} while "
                                 "starting (its log is above)")
            if time.monotonic() > deadline:
                raise ValueError(f"replica {rank} did not answer /health in "
                                 f"{REPLICA_START_TIMEOUT_S} s")
            time.sleep(0.5)


class _Stopped(Exception):
    """SIGTERM or SIGINT reached the launcher."""


def _stop_on_signals() -> None:
    def stop(signum, frame) -> None:
        for ignored in (signal.SIGTERM, signal.SIGINT):  # a repeat must not cut the drain
            signal.signal(ignored, signal.SIG_IGN)
        raise _Stopped()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


def _terminate(processes: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM every process at once; SIGKILL those still running `timeout_s` s later."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            logger.warning("process %d still running %.0f s after SIGTERM: killed", process.pid,
                           timeout_s)
            process.kill()
            process.wait()
