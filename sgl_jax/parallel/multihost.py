"""Multi-host serving: rank 0 schedules, every rank runs the same device steps.

JAX's multi-controller runtime needs every process to launch the same jitted computations in
the same order. Rank 0 owns the scheduler; before each device call (a runner method marked
`device_call`) it sends the call (method and host arguments) to the other ranks over a TCP
channel at --dist-init-addr's port + 1, and they replay it on their own runner. Warm-up runs
on every rank from the same settings, so it needs no messages.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")  # the pickled message's length
_STOP = ("stop",)


def channel_address(dist_init_addr: str) -> tuple[str, int]:
    host, _, port = dist_init_addr.rpartition(":")
    return host, int(port) + 1


class StepSender:
    """Rank 0's end: waits for every follower, then sends each call to all of them."""

    def __init__(self, address: tuple[str, int], num_followers: int, timeout: float = 600.0):
        self._server = socket.create_server(address, reuse_port=False)
        self._server.settimeout(timeout)
        self._peers = []
        for _ in range(num_followers):
            try:
                peer, _ = self._server.accept()
            except TimeoutError:
                raise RuntimeError(f"only {len(self._peers)} of {num_followers} other ranks "
                                   f"connected to {address} within {timeout:.0f} s") from None
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers.append(peer)
        logger.info("Rank 0 leads %d other rank(s) over %s:%d", num_followers, *address)

    def send(self, message: tuple) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for peer in self._peers:
            peer.sendall(_HEADER.pack(len(payload)) + payload)

    def close(self) -> None:
        """Tell the followers to stop, then hang up."""
        if not self._peers:
            return
        try:
            self.send(_STOP)
        finally:
            for peer in self._peers:
                peer.close()
            self._server.close()
            self._peers = []


def connect_when_listening(address: tuple[str, int], timeout_s: float, what: str
                           ) -> socket.socket:
    """A blocking connection to `address`, retried while its peer is still starting (a
    TimeoutError naming `what` after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} at {address} did not answer within "
                                   f"{timeout_s:.0f} s") from None
            time.sleep(0.2)
    sock.settimeout(None)  # an idle peer may send nothing for as long as it likes
    return sock


class StepReceiver:
    """A follower's end: connects to rank 0 (retrying while it is still starting)."""

    def __init__(self, address: tuple[str, int], timeout: float = 600.0):
        self._sock = connect_when_listening(address, timeout, "rank 0's step channel")

    def receive(self) -> tuple | None:
        """The next call, or None once rank 0 stops or goes away."""
        header = self._read(_HEADER.size)
        message = None if header is None else self._read(_HEADER.unpack(header)[0])
        if message is None:
            return None
        call = pickle.loads(message)
        return None if call == _STOP else call

    def _read(self, size: int) -> bytes | None:
        chunks, left = [], size
        while left:
            chunk = self._sock.recv(min(left, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self._sock.close()


def device_call(method: Callable) -> Callable:
    """Marks a runner method that launches device work: on rank 0 of several, each call is
    sent to the other ranks first, which replay it (`Mirrored`, `follow`). Only marked
    methods are sent or replayed."""
    method.replayed_by_followers = True
    return method


def is_device_call(method: Any) -> bool:
    return getattr(method, "replayed_by_followers", False)


class Mirrored:
    """Rank 0's view of a runner: its device calls are sent to the followers, then run."""

    def __init__(self, target: Any, name: str, sender: StepSender):
        self._target, self._name, self._sender = target, name, sender

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._target, attr)
        if not is_device_call(value):
            return value

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            self._sender.send((self._name, attr, args, kwargs))
            return value(*args, **kwargs)
        return mirrored


def follow(receiver: StepReceiver, targets: dict[str, Any]) -> int:
    """Replay rank 0's calls on this rank's runners until it stops; returns the calls run.

    A call that raises is logged and skipped, as rank 0's engine fails that step's requests
    and goes on serving."""
    count = 0
    while (call := receiver.receive()) is not None:
        name, method, args, kwargs = call
        try:
            replayed = getattr(targets[name], method)
            if not is_device_call(replayed):
                raise TypeError(f"{name}.{method} is not a device call")
            replayed(*args, **kwargs)
        except Exception:
            logger.exception("replaying rank 0's %s.%s failed", name, method)
        count += 1
    return count
