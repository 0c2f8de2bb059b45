"""Decode batches: every running request one token (or one verify round) further,
retracting requests when KV runs out."""

from __future__ import annotations

from collections.abc import Callable

from sgl_jax.scheduler.cache_manager import CacheManager
from sgl_jax.scheduler.req import Req


class DecodeManager:
    def __init__(self, cache: CacheManager, retract: Callable[[Req], None],
                 settle: Callable[[], bool] = lambda: False, lookahead: int = 1):
        self.cache = cache
        self.lookahead = lookahead  # KV slots past kv_len a step writes (a verify round: more)
        self.retract = retract  # frees a request's pages and sends it back to the queue
        # Reads the step in flight, if any (True then): requests it ends free their pages.
        self.settle = settle
        self.num_retractions = 0

    def schedule(self, running: list[Req]) -> list[Req]:
        """One token for each request whose prompt is fully computed and whose sampled tokens
        do not already reach its end. When pages run out, the step in flight is settled
        first (a retracted request must have read all its tokens), then the most recently
        admitted requests are retracted until the rest fit."""
        ready = [req for req in running if req.decodes_next]
        fits = self._reserve_all(ready)
        if not fits and self.settle():
            ready = [req for req in running if req.decodes_next]
            fits = self._reserve_all(ready)
        while ready and not fits:
            victim = ready.pop()
            running.remove(victim)
            self.retract(victim)
            self.num_retractions += 1
            fits = self._reserve_all(ready)
        return ready

    def _reserve_all(self, reqs: list[Req]) -> bool:
        # A speculative round in flight may commit up to inflight_extra more tokens.
        return all(self.cache.reserve(req, min(req.kv_len + req.inflight_extra + self.lookahead,
                                               req.context_len))
                   for req in reqs)
