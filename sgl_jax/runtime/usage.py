"""RuntimeUsage: what a runtime holds now, read on the engine thread (Engine.usage())."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_jax.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class RuntimeUsage:
    running_requests: int
    waiting_requests: int
    pages_total: int  # KV pages requests can hold (the null page not counted)
    pages_free: int  # neither held by a request nor cached
    pages_in_use: int  # held by requests (cached pages that may be evicted do not count)
    pages_cached: int  # held only by the radix cache, evictable
    state_slots_total: int  # recurrent-state slots (hybrid models; 0 for others)
    state_slots_in_use: int

    @property
    def all_pages_free(self) -> bool:
        """No page held by a request or cached (cached ones stay until flush_cache)."""
        return self.pages_free == self.pages_total

    def server_info(self) -> dict[str, Any]:
        """The figures as /get_server_info names them."""
        info = {"num_running_reqs": self.running_requests,
                "num_queued_reqs": self.waiting_requests,
                "token_usage": self.pages_in_use / self.pages_total,
                "kv_pages_in_use": self.pages_in_use, "kv_pages_cached": self.pages_cached,
                "kv_pages_total": self.pages_total}
        if self.state_slots_total:
            info |= {"state_slots_in_use": self.state_slots_in_use,
                     "state_slots_total": self.state_slots_total}
        return info


def usage_of(scheduler: Scheduler) -> RuntimeUsage:
    cache = scheduler.cache
    states = cache.states
    return RuntimeUsage(
        running_requests=len(scheduler.running),
        waiting_requests=len(scheduler.prefill.waiting),
        pages_total=cache.allocator.capacity, pages_free=cache.allocator.num_free,
        pages_in_use=cache.used_pages,
        pages_cached=cache.radix.evictable_pages if cache.radix else 0,
        state_slots_total=states.capacity if states else 0,
        state_slots_in_use=states.capacity - states.num_free if states else 0)
