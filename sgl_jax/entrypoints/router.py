"""`--dp-size N`: N replicas of the server behind SGLang's router, from one command.

Each replica is a whole server (`python -m sgl_jax.launch_server` with the same flags) in its
own process on its own `--tp-size` devices, listening on a free local port; SGLang's router
(`sglang-router`, the optional extra `sgl-jax[router]`) serves `--host`/`--port` in front of
them, with its routing policy, health checks and retries. The launcher stops every process
when it is stopped or when the router exits; a replica that dies is the router's to route
around.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

from sgl_jax.server_args import ServerArgs

logger = logging.getLogger("sgl_jax.router")

ROUTER_EXTRA = 'pip install "sgl-jax[router]"'
# Flags the launcher answers itself; each replica gets the rest unchanged.
_LAUNCHER_FLAGS = {"--dp-size": True, "--dp": True, "--router-policy": True, "--port": True,
                   "--host": True}  # flag: takes a value
REPLICA_START_TIMEOUT_S = 1800  # a large model's load and warm-up
# The router checks each replica this often, so a dead one leaves the rotation in seconds.
HEALTH_CHECK_INTERVAL_S = 2


def serve_replicas(args: ServerArgs, argv: Sequence[str]) -> int:
    """Start args.dp_size replicas and the router; run until stopped. Returns an exit code."""
    _require_router()
    device_envs = replica_device_envs(args)
    replicas = [_start_replica(argv, env, rank) for rank, env in enumerate(device_envs)]
    processes = [process for process, _ in replicas]
    _stop_on_signals()
    try:
        urls = [url for _, url in replicas]
        _wait_healthy(replicas)
        router = subprocess.Popen(router_command(args, urls))
        processes.append(router)
        logger.info("Serving %d replicas (%s) behind SGLang's router on http://%s:%d",
                    len(urls), ", ".join(urls), args.host, args.port)
        return router.wait()
    except _Stopped:
        return 0
    finally:
        _terminate(processes)


def _require_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError(f"--dp-size needs SGLang's router, which is not installed: "
                         f"{ROUTER_EXTRA}")


def replica_device_envs(args: ServerArgs) -> list[dict[str, str]]:
    """Environment overrides giving each replica its own tp_size devices (GPU); on the CPU
    the replicas share the host."""
    device = args.device or ("gpu" if _visible_gpus() else "cpu")
    if device == "cpu":
        return [{} for _ in range(args.dp_size)]
    if device == "tpu":
        raise NotImplementedError(
            "--dp-size on TPU is not supported: start one server per chip group "
            "(TPU_VISIBLE_CHIPS) and SGLang's router in front of them (docs/parallel.md)")
    gpus = _visible_gpus()
    needed = args.dp_size * args.tp_size
    if needed > len(gpus):
        raise ValueError(f"--dp-size {args.dp_size} x --tp-size {args.tp_size} needs {needed} "
                         f"GPUs, {len(gpus)} visible")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[rank * args.tp_size:
                                                    (rank + 1) * args.tp_size])}
            for rank in range(args.dp_size)]


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
            # its metrics port is fixed otherwise, and a second router on the host fails
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warn" if args.log_level in ("warning", "error") else "info"]


def _start_replica(argv: Sequence[str], env: dict[str, str], rank: int
                   ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "sgl_jax.launch_server", *replica_argv(argv),
               "--host", "127.0.0.1", "--port", str(port)]
    logger.info("Starting replica %d on port %d%s", rank, port,
                f" ({env})" if env else "")
    # Its own process group: Ctrl+C reaches the launcher, which stops replicas in order.
    process = subprocess.Popen(command, env={**os.environ, **env}, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


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


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


class _Stopped(Exception):
    """SIGTERM or SIGINT reached the launcher."""


def _stop_on_signals() -> None:
    def stop(signum, frame) -> None:
        raise _Stopped()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


def _terminate(processes: Sequence[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
