"""The waiting queue and extend batches: unfinished chunked prefills first, then new requests."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sgl_jax.model_executor.forward_batch import EXTEND_Q_BLOCK, aligned
from sgl_jax.scheduler.cache_manager import CacheManager
from sgl_jax.scheduler.req import Req


@dataclass(frozen=True)
class PrefillLimits:
    max_prefill_tokens: int  # tokens in one extend batch, each chunk rounded up to a block
    chunk_size: int  # new tokens of one request in one extend batch
    max_running_requests: int
    # Extra KV slots reserved past a completed prompt: the first draft tree's scratch.
    completion_lookahead: int = 0
    # Speculative decoding: a prompt's last token is computed by prefill, never left alone to
    # a decode step (a verify round needs the draft tree that completing a prompt grows).
    prompt_ends_in_prefill: bool = False


class PrefillManager:
    def __init__(self, cache: CacheManager, limits: PrefillLimits,
                 on_admit: Callable[[Req, int], None] | None = None,
                 batch_limit: Callable[[int], int] | None = None,
                 prefill_limit: Callable[[int], int] | None = None):
        self.cache = cache
        self.limits = limits
        # The most requests that may run given the programs built so far (Decoding's
        # batch_limit), asked with how many would run if all waiting ones were admitted.
        self.batch_limit = batch_limit or (lambda wanted: limits.max_running_requests)
        # The same for the tokens of one extend batch (Decoding's prefill_limit).
        self.prefill_limit = prefill_limit or (lambda wanted: limits.max_prefill_tokens)
        # Called before a request is admitted (again, if admission fails for want of pages)
        # with the size of the batch it joins: the running requests and as many waiting ones
        # as may run.
        self.on_admit = on_admit
        self.waiting: deque[Req] = deque()

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request goes first, so it resumes before newer ones start."""
        self.waiting.appendleft(req)

    def schedule(self, running: list[Req]) -> list[tuple[Req, int]]:
        """Pick (request, tokens to compute) pairs for one extend batch; admitted requests
        are appended to `running`."""
        batch: list[tuple[Req, int]] = []
        partial = [req for req in running if req.tokens_to_compute > 1]
        if not partial and not self.waiting:
            return batch  # the common decode step: nothing to extend
        budget = self._token_budget(partial)
        for req in partial:
            if budget > 0:
                budget -= self._take_chunk(req, budget, batch)
        most = self.limits.max_running_requests
        if self.waiting:
            most = min(most, self.batch_limit(len(running) + len(self.waiting)))
        while self._can_admit(running, budget, most):
            req = self.waiting[0]
            if self.on_admit is not None:
                self.on_admit(req, min(len(running) + len(self.waiting), most))
            self.cache.admit(req)
            taken = self._take_chunk(req, budget, batch)
            if not taken:
                self.cache.release(req)
                req.kv_len = 0
                break
            self.waiting.popleft()
            running.append(req)
            budget -= taken
        return batch

    def _token_budget(self, partial: list[Req]) -> int:
        """max_prefill_tokens, or less while the larger token buckets are being built
        (`partial`: the running requests with prompt tokens left to compute)."""
        most = self.limits.max_prefill_tokens
        wanted = 0
        for req in itertools.chain(partial, self.waiting):
            wanted += aligned(min(req.tokens_to_compute, self.limits.chunk_size))
            if wanted >= most:
                break
        return min(most, self.prefill_limit(wanted)) if wanted else most

    def _can_admit(self, running: list[Req], budget: int, most: int) -> bool:
        return bool(self.waiting) and budget > 0 and len(running) < most \
            and self.cache.can_admit

    def _take_chunk(self, req: Req, budget: int, batch: list[tuple[Req, int]]) -> int:
        """Add up to a chunk of the request's tokens; returns the batch space it takes."""
        count = min(req.tokens_to_compute, self.limits.chunk_size)
        if aligned(count) > budget:  # a chunk that does not fit stops at a block boundary
            count = budget // EXTEND_Q_BLOCK * EXTEND_Q_BLOCK
        if self.limits.prompt_ends_in_prefill and req.tokens_to_compute - count == 1:
            count -= 1  # leaves two tokens for the next chunk
        needed = req.kv_len + count
        if count == req.tokens_to_compute:
            needed = min(needed + self.limits.completion_lookahead, req.context_len)
        if not count or not self.cache.reserve(req, needed):
            return 0
        batch.append((req, count))
        return aligned(count)
