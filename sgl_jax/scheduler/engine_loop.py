"""The thread that owns the device: it runs the scheduler; other threads only send it commands."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sgl_jax.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

_STOP = object()


class EngineLoop:
    def __init__(self, scheduler: Scheduler, on_crash: Callable[[BaseException], None]):
        self.scheduler = scheduler
        self._on_crash = on_crash
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sgl-jax-engine", daemon=True)
        self._thread.start()

    def submit(self, command: Callable[[Scheduler], Any]) -> Future:
        """Run `command(scheduler)` on the engine thread between two steps."""
        future: Future = Future()
        self._inbox.put((command, future))
        return future

    def call(self, command: Callable[[Scheduler], Any]) -> Any:
        return self.submit(command).result()

    def stop(self) -> None:
        self._inbox.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while self._drain_inbox(block=not self.scheduler.has_work):
            try:
                self.scheduler.step()
            except Exception as exc:  # a failing step must not kill the thread silently
                logger.exception("engine step failed")
                self._on_crash(exc)

    def _drain_inbox(self, block: bool) -> bool:
        """Run pending commands; False once asked to stop."""
        while True:
            waiting_since = time.perf_counter()
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if block:  # the scheduler had nothing to run until this command came
                self.scheduler.stats.idle_s += time.perf_counter() - waiting_since
            if item is _STOP:
                return False
            command, future = item
            try:
                future.set_result(command(self.scheduler))
            except Exception as exc:
                future.set_exception(exc)
            block = False
