"""A fixed batch run to completion: prefill every request together, then decode in lockstep.

This is the first generation path; a continuous-batching scheduler replaces it behind the
same Engine interface.
"""

from __future__ import annotations

import numpy as np

from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.model_executor.forward_batch import SeqChunk
from sgl_jax.model_executor.model_runner import ModelRunner
from sgl_jax.scheduler.req import Req


def run_static_batch(
    runner: ModelRunner, allocator: PageAllocator, reqs: list[Req], eos_ids: frozenset[int]
) -> None:
    active = [r for r in reqs if r.params.max_new_tokens > 0]
    for req in reqs:
        if req.params.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
    _allocate_pages(allocator, active, runner.page_size)
    try:
        chunks = [SeqChunk(r.prompt_ids, 0, r.page_ids) for r in active]
        while active:
            logits, _ = runner.forward(chunks)
            for req, token in zip(active, np.argmax(logits, axis=-1), strict=True):
                req.append_token(int(token), eos_ids)
            active = [r for r in active if not r.finished]
            chunks = [SeqChunk([r.output_ids[-1]], r.seq_len - 1, r.page_ids) for r in active]
    finally:
        for req in reqs:
            allocator.free(req.page_ids)
            req.page_ids = []


def _allocate_pages(allocator: PageAllocator, reqs: list[Req], page_size: int) -> None:
    # The last generated token is never written to the cache, hence the - 1.
    needed = [-(-(len(r.prompt_ids) + r.params.max_new_tokens - 1) // page_size) for r in reqs]
    if sum(needed) > allocator.num_free:
        raise ValueError(
            f"the batch needs {sum(needed)} KV pages of {page_size} tokens but only "
            f"{allocator.num_free} are free; raise max_total_tokens or send fewer requests"
        )
    for req, count in zip(reqs, needed, strict=True):
        req.page_ids = allocator.allocate(count)
