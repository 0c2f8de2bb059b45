"""KV pages for requests: prefix reuse through the radix cache, allocation, eviction, release;
and for hybrid models each running request's recurrent-state slot."""

from __future__ import annotations

from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.mem_cache.radix_cache import RadixCache
from sgl_jax.mem_cache.state_slots import NULL_SLOT, StateSlotAllocator
from sgl_jax.scheduler.page_reuse import PageReuse, ReuseEveryPage
from sgl_jax.scheduler.req import Req


class CacheManager:
    def __init__(self, allocator: PageAllocator, radix: RadixCache | None, page_size: int,
                 *, page_reuse: PageReuse | None = None,
                 states: StateSlotAllocator | None = None):
        self.allocator = allocator
        # Hybrid models: a slot of the recurrent-state pool per request, from admission to
        # release (finish, abort, retraction). A state cannot be rebuilt from cached KV pages,
        # so such models run without the radix cache.
        self.states = states
        # Which pages of a matched prefix a request may read (the decoding's rule).
        self.page_reuse = page_reuse or ReuseEveryPage()
        self.radix = radix
        self.page_size = page_size
        self.cache_hit_tokens = 0
        self.cache_query_tokens = 0

    @property
    def can_admit(self) -> bool:
        """Whether a new request can get what admission gives it (a free state slot)."""
        return self.states is None or self.states.num_free > 0

    def admit(self, req: Req) -> None:
        """A request about to start: its state slot (hybrid models), and the cached pages of
        its longest known prefix (locked)."""
        if self.states is not None:
            req.state_slot = self.states.allocate()
        self.match_prefix(req)

    def match_prefix(self, req: Req) -> None:
        """Give a request the cached pages of its longest known prefix (and lock them)."""
        if self.radix is None:
            return
        # At least the last token is computed, because its logits pick the next token.
        match = self.radix.match_prefix(req.all_ids[:-1])
        pages, node = list(match.page_ids), match.node
        usable = self.page_reuse.usable_pages(req, pages)
        if usable < len(pages):  # lock only what it reads: the rest may take its copies
            pages = pages[:usable]
            node = self.radix.match_prefix(req.all_ids[: usable * self.page_size]).node
        self.radix.lock(node)
        req.prefix_node = node
        req.page_ids = pages
        req.kv_len = req.cached_tokens = len(pages) * self.page_size
        self.cache_hit_tokens += req.cached_tokens
        self.cache_query_tokens += len(req.all_ids)

    def reserve(self, req: Req, num_tokens: int) -> bool:
        """Make req.page_ids cover `num_tokens` tokens, evicting cached pages if needed."""
        missing = -(-num_tokens // self.page_size) - len(req.page_ids)
        if missing <= 0:
            return True
        if missing > self.allocator.num_free and self.radix is not None:
            self.radix.evict(missing - self.allocator.num_free)
        if missing > self.allocator.num_free:
            return False
        req.page_ids.extend(self.allocator.allocate(missing))
        return True

    def release(self, req: Req) -> None:
        """Return a request's pages (with the radix cache its computed full pages stay cached)
        and its state slot, whose state is lost: a retracted request recomputes from scratch."""
        if req.state_slot != NULL_SLOT:
            self.states.free(req.state_slot)
            req.state_slot = NULL_SLOT
        pages, req.page_ids = req.page_ids, []
        if self.radix is None:
            self.allocator.free(pages)
            return
        duplicates = self.radix.insert(req.all_ids[: req.kv_len], pages,
                                       self.page_reuse.replaces_held(req))
        full_pages = req.kv_len // self.page_size
        matched = req.cached_tokens // self.page_size
        self.page_reuse.record(req, pages[matched:full_pages], matched, set(duplicates))
        self.allocator.free(duplicates + pages[full_pages:])
        if req.prefix_node is not None:
            self.radix.unlock(req.prefix_node)
            req.prefix_node = None

    @property
    def available_pages(self) -> int:
        evictable = self.radix.evictable_pages if self.radix is not None else 0
        return self.allocator.num_free + evictable

    @property
    def used_pages(self) -> int:
        """Pages held by requests (cached but evictable pages do not count)."""
        return self.allocator.capacity - self.available_pages

    def flush(self) -> None:
        if self.radix is not None:
            self.radix.reset()
