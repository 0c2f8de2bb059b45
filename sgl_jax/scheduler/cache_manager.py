"""KV pages for requests: prefix reuse through the radix cache, allocation, eviction, release;
and for hybrid models each running request's recurrent-state slot."""

from __future__ import annotations

from collections.abc import Callable

from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.mem_cache.radix_cache import RadixCache
from sgl_jax.mem_cache.state_slots import NULL_SLOT, StateSlotAllocator
from sgl_jax.scheduler.req import Req


class CacheManager:
    def __init__(self, allocator: PageAllocator, radix: RadixCache | None, page_size: int,
                 *, last_slot_needs_next_token: bool = False,
                 states: StateSlotAllocator | None = None):
        self.allocator = allocator
        # Hybrid models: a slot of the recurrent-state pool per request, from admission to
        # release (finish, abort, retraction). A state cannot be rebuilt from cached KV pages,
        # so such models run without the radix cache.
        self.states = states
        # EAGLE3's draft KV at slot j depends on token j + 1 as well, so a cached page's last
        # slot holds what the draft computed with the token after the page of the request that
        # cached it: recorded per page, a request with a draft reuses a page only if it
        # continues alike (one without a draft reads only the target's K/V).
        self.last_slot_needs_next_token = last_slot_needs_next_token
        self._next_token_of_page: dict[int, int] = {}
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
        if self.last_slot_needs_next_token and req.drafting:
            usable = self._pages_whose_next_token_matches(pages, req.all_ids)
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
                                       self._draft_copy_is_better(req))
        full_pages = req.kv_len // self.page_size
        if self.last_slot_needs_next_token:
            matched = req.cached_tokens // self.page_size
            self._record_next_tokens(req.all_ids, pages[matched:full_pages], matched,
                                     set(duplicates), req.draft_len)
        self.allocator.free(duplicates + pages[full_pages:])
        if req.prefix_node is not None:
            self.radix.unlock(req.prefix_node)
            req.prefix_node = None

    def _draft_copy_is_better(self, req: Req) -> Callable[[int, int], bool] | None:
        """For radix insert: whether the request's page at an index should replace the tree's
        copy `held`, which has no record (its draft slots were never filled: it was computed
        without a draft) where the request's draft filled its own."""
        if not (self.last_slot_needs_next_token and req.drafting):
            return None
        return lambda index, held: (held not in self._next_token_of_page
                                    and (index + 1) * self.page_size <= req.draft_len)

    def _pages_whose_next_token_matches(self, pages: list[int], token_ids: list[int]) -> int:
        """How many leading cached pages a request continuing with token_ids may reuse: up to
        the first whose last draft slot was computed with another next token."""
        for i, page in enumerate(pages):
            if self._next_token_of_page.get(page) != token_ids[(i + 1) * self.page_size]:
                return i
        return len(pages)

    def _record_next_tokens(self, token_ids: list[int], new_pages: list[int], first: int,
                            duplicates: set[int], draft_len: int) -> None:
        """The next token of every page a request computed (its full pages from the
        `first`, past those it matched, whose records stand) that the tree now holds. A page
        the draft had not filled (plain rounds left it behind, or the request had no draft)
        gets no record: no request reuses it."""
        for i, page in enumerate(new_pages, start=first):
            if page in duplicates:
                continue
            after = (i + 1) * self.page_size
            if after <= draft_len:
                self._next_token_of_page[page] = token_ids[after]
            else:
                self._next_token_of_page.pop(page, None)

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
