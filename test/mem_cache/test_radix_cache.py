import random
from dataclasses import dataclass

import pytest

from sgl_jax.mem_cache.page_allocator import PageAllocator
from sgl_jax.mem_cache.radix_cache import RadixCache

PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 4])


def make_cache(page_size: int, num_pages: int = 32) -> tuple[RadixCache, PageAllocator]:
    allocator = PageAllocator(num_pages)
    return RadixCache(allocator, page_size), allocator


def pages_of(page_size: int, *symbols: int, tail: int = 0) -> list[int]:
    """Token ids for one full page per symbol (distinct tokens inside a page), then `tail` extra."""
    tokens = [symbol * 100 + i for symbol in symbols for i in range(page_size)]
    return tokens + [999] * tail


def cache_sequence(cache, allocator, tokens) -> list[int]:
    """Cache tokens as a request would: reuse the matched pages, allocate the rest."""
    matched = cache.match_prefix(tokens).page_ids
    pages = matched + allocator.allocate(len(tokens) // cache.page_size - len(matched))
    assert cache.insert(tokens, pages) == []
    return pages


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached page-aligned prefix -> the page holding its last page of tokens."""
    contents, stack = {}, [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for i, page in enumerate(node.page_ids):
            contents[prefix + node.key[: (i + 1) * cache.page_size]] = page
        stack.extend((child, prefix + node.key) for child in node.children.values())
    return contents


@PAGE_SIZES
def test_match_on_empty_tree(page_size):
    cache, _ = make_cache(page_size)
    match = cache.match_prefix(pages_of(page_size, 1, 2))
    assert (match.page_ids, match.num_tokens, match.node) == ([], 0, cache.root)
    assert cache.cached_pages == cache.evictable_pages == 0


@PAGE_SIZES
def test_insert_then_full_match_ignores_the_partial_page(page_size):
    cache, allocator = make_cache(page_size)
    tokens = pages_of(page_size, 1, 2, 3, tail=page_size - 1)
    pages = allocator.allocate(4)  # 3 full pages + 1 partly filled (or unused when page_size 1)
    assert cache.insert(tokens, pages) == []
    match = cache.match_prefix(tokens)
    assert match.page_ids == pages[:3] and match.num_tokens == 3 * page_size
    assert cache.cached_pages == cache.evictable_pages == 3
    cache.check_invariants()


@PAGE_SIZES
def test_partial_match_stops_at_a_page_boundary(page_size):
    cache, allocator = make_cache(page_size)
    cached = pages_of(page_size, 1, 2, 3)
    pages = cache_sequence(cache, allocator, cached)
    prompt = cached[: 2 * page_size - 1] + [7777] * 3  # diverges on the last token of page 2
    match = cache.match_prefix(prompt)
    assert match.page_ids == pages[:1] and match.num_tokens == page_size


def test_ten_token_prompt_sharing_seven_tokens_matches_one_page():
    cache, allocator = make_cache(page_size=4)
    pages = cache_sequence(cache, allocator, list(range(12)))
    match = cache.match_prefix(list(range(7)) + [50, 51, 52])
    assert (match.page_ids, match.num_tokens) == (pages[:1], 4)


@PAGE_SIZES
def test_match_splits_an_edge_and_the_handle_locks_only_the_matched_part(page_size):
    cache, allocator = make_cache(page_size)
    cached = pages_of(page_size, 1, 2, 3)
    pages = cache_sequence(cache, allocator, cached)  # one node of 3 pages
    match = cache.match_prefix(pages_of(page_size, 1, 2, 9))
    assert match.page_ids == pages[:2]
    assert match.node.key == tuple(cached[: 2 * page_size]) and len(match.node.children) == 1
    cache.check_invariants()
    cache.lock(match.node)
    assert cache.evict(10) == 1  # only the split-off third page is unlocked
    assert cache.match_prefix(cached).page_ids == pages[:2]
    cache.check_invariants()


@PAGE_SIZES
def test_insert_of_a_diverging_sequence_splits_the_edge(page_size):
    cache, allocator = make_cache(page_size)
    first = cache_sequence(cache, allocator, pages_of(page_size, 1, 2, 3))
    own = allocator.allocate(2)
    diverging = pages_of(page_size, 1, 2, 4, 5)
    assert cache.insert(diverging, first[:2] + own) == []  # the shared pages are the tree's own
    assert cache.cached_pages == 5
    assert cache.match_prefix(diverging).page_ids == first[:2] + own
    assert cache.match_prefix(pages_of(page_size, 1, 2, 3)).page_ids == first
    (shared,) = cache.root.children.values()
    assert shared.page_ids == first[:2] and len(shared.children) == 2
    cache.check_invariants()


@PAGE_SIZES
def test_request_lifecycle_frees_only_its_own_extra_pages(page_size):
    cache, allocator = make_cache(page_size)
    prompt = pages_of(page_size, 1, 2)
    cache_sequence(cache, allocator, prompt)
    match = cache.match_prefix(prompt + [5] * page_size)
    cache.lock(match.node)
    full = prompt + pages_of(page_size, 6, tail=page_size - 1)  # 3 full pages + a partial one
    own = allocator.allocate(2)
    all_pages = match.page_ids + own
    assert cache.insert(full, all_pages) == []
    allocator.free(all_pages[len(full) // page_size :])
    cache.unlock(match.node)
    assert cache.cached_pages == 3 and allocator.num_free == allocator.capacity - 3
    cache.check_invariants()


@PAGE_SIZES
def test_duplicate_insert_reports_the_callers_pages_and_adopts_nothing_twice(page_size):
    cache, allocator = make_cache(page_size)
    tokens = pages_of(page_size, 1, 2, 3)
    winner, loser = allocator.allocate(3), allocator.allocate(3)  # both prefilled the same prompt
    assert cache.insert(tokens, winner) == []
    assert cache.insert(tokens, loser) == loser
    assert cache.cached_pages == 3 and cache.match_prefix(tokens).page_ids == winner
    allocator.free(loser)
    assert cache.cached_pages + allocator.num_free == allocator.capacity
    # A longer sequence over the same prefix: shared pages are duplicates, the new one is adopted.
    longer = allocator.allocate(4)
    assert cache.insert(pages_of(page_size, 1, 2, 3, 4), longer) == longer[:3]
    assert cache.match_prefix(pages_of(page_size, 1, 2, 3, 4)).page_ids == winner + longer[3:]
    cache.check_invariants()


@PAGE_SIZES
def test_an_unlocked_node_takes_the_callers_pages_it_prefers(page_size):
    cache, allocator = make_cache(page_size)
    tokens = pages_of(page_size, 1, 2, 3)
    first, second = allocator.allocate(3), allocator.allocate(3)
    assert cache.insert(tokens, first) == []
    asked = []
    def prefer_the_last_two(index, held):
        asked.append((index, held))
        return index >= 1
    # the tree swaps in the caller's last two pages and hands back the two it held
    assert cache.insert(tokens, second, prefer_the_last_two) == [second[0], first[1], first[2]]
    assert asked == list(zip(range(3), first, strict=True))
    assert cache.match_prefix(tokens).page_ids == [first[0], second[1], second[2]]
    allocator.free([second[0], first[1], first[2]])
    assert cache.cached_pages + allocator.num_free == allocator.capacity
    cache.check_invariants()
    # a node some request reads (locked, directly or through a descendant) keeps its pages
    third = allocator.allocate(3)
    locked = cache.match_prefix(pages_of(page_size, 1, 2)).node
    cache.lock(locked)
    assert cache.insert(tokens, third, lambda index, held: True) == [third[0], third[1],
                                                                      second[2]]
    assert cache.match_prefix(tokens).page_ids == [first[0], second[1], third[2]]
    cache.unlock(locked)
    cache.check_invariants()


@PAGE_SIZES
def test_insert_refuses_pages_the_tree_holds_elsewhere(page_size):
    cache, allocator = make_cache(page_size)
    held = cache_sequence(cache, allocator, pages_of(page_size, 1))
    with pytest.raises(ValueError, match="already held by the tree"):
        cache.insert(pages_of(page_size, 2), held)
    with pytest.raises(ValueError, match="full pages"):
        cache.insert(pages_of(page_size, 3, 4), allocator.allocate(1))
    cache.check_invariants()


@PAGE_SIZES
def test_a_lock_protects_the_path_and_evict_returns_fewer_pages(page_size):
    cache, allocator = make_cache(page_size)
    kept = cache_sequence(cache, allocator, pages_of(page_size, 1, 2))
    cache_sequence(cache, allocator, pages_of(page_size, 1, 3))  # shares page 1 with the lock
    cache_sequence(cache, allocator, pages_of(page_size, 4))
    match = cache.match_prefix(pages_of(page_size, 1, 2))
    cache.lock(match.node)
    assert cache.evictable_pages == 2
    assert cache.evict(10) == 2
    assert cache.match_prefix(pages_of(page_size, 1, 2)).page_ids == kept
    assert cache.cached_pages == 2 and cache.evictable_pages == 0
    cache.unlock(match.node)
    assert cache.evict(10) == 2 and allocator.num_free == allocator.capacity
    cache.check_invariants()


@PAGE_SIZES
def test_lru_evicts_the_least_recently_used_branch_first(page_size):
    cache, allocator = make_cache(page_size)
    a, b, c = (pages_of(page_size, s) for s in (1, 2, 3))
    for tokens in (a, b, c):
        cache_sequence(cache, allocator, tokens)
    stale = cache.match_prefix(b).node
    cache.match_prefix(a)
    cache.match_prefix(c)
    cache.match_prefix(a)  # recency now: b < c < a
    assert cache.evict(1) == 1 and cache.match_prefix(b).num_tokens == 0
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(stale)
    assert cache.evict(1) == 1 and cache.match_prefix(c).num_tokens == 0
    assert cache.match_prefix(a).num_tokens == page_size


@PAGE_SIZES
def test_eviction_cascades_to_parents_and_frees_whole_nodes(page_size):
    cache, allocator = make_cache(page_size)
    cache_sequence(cache, allocator, pages_of(page_size, 1, 2))
    cache_sequence(cache, allocator, pages_of(page_size, 1, 3))  # tree: 1 -> {2, 3}
    assert cache.evict(2) == 2  # both leaves; the parent only became a leaf once they were gone
    assert cache.match_prefix(pages_of(page_size, 1, 2)).num_tokens == page_size
    assert cache.evict(1) == 1 and cache.cached_pages == 0
    cache_sequence(cache, allocator, pages_of(page_size, 5, 6, 7))
    assert cache.evict(1) == 3  # a node goes as a whole
    assert allocator.num_free == allocator.capacity
    cache.check_invariants()


@PAGE_SIZES
def test_reset_frees_everything_and_refuses_while_locked(page_size):
    cache, allocator = make_cache(page_size)
    cache_sequence(cache, allocator, pages_of(page_size, 1, 2))
    cache_sequence(cache, allocator, pages_of(page_size, 3))
    match = cache.match_prefix(pages_of(page_size, 1))
    cache.lock(match.node)
    with pytest.raises(RuntimeError, match="locks held"):
        cache.reset()
    assert cache.cached_pages == 3
    cache.unlock(match.node)
    cache.reset()
    assert cache.cached_pages == 0 and allocator.num_free == allocator.capacity
    assert cache.match_prefix(pages_of(page_size, 1, 2)).num_tokens == 0
    with pytest.raises(ValueError, match="reset"):
        cache.lock(match.node)
    cache.check_invariants()


@PAGE_SIZES
def test_unlock_underflow_raises(page_size):
    cache, allocator = make_cache(page_size)
    cache_sequence(cache, allocator, pages_of(page_size, 1, 2))
    parent = cache.match_prefix(pages_of(page_size, 1)).node
    child = cache.match_prefix(pages_of(page_size, 1, 2)).node
    cache.lock(child)
    with pytest.raises(ValueError, match="without a matching lock"):
        cache.unlock(parent)  # locked only through its child
    cache.unlock(child)
    with pytest.raises(ValueError, match="without a matching lock"):
        cache.unlock(child)
    cache.check_invariants()


# --- randomized check against a brute-force model ---


class ReferenceCache:
    """Every cached page-aligned prefix -> the page of its last page, with its last use and locks.
    Eviction removes one page at a time: the least recently used unlocked prefix nobody extends."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: dict[tuple[int, ...], int] = {}
        self.last_use: dict[tuple[int, ...], int] = {}
        self.locks: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def prefixes(self, tokens) -> list[tuple[int, ...]]:
        num_pages = len(tokens) // self.page_size
        return [tuple(tokens[: k * self.page_size]) for k in range(1, num_pages + 1)]

    def match(self, tokens) -> list[int]:
        self.clock += 1
        matched = []
        for prefix in self.prefixes(tokens):
            if prefix not in self.pages:
                break
            matched.append(self.pages[prefix])
            self.last_use[prefix] = self.clock
        return matched

    def insert(self, tokens, page_ids) -> list[int]:
        self.clock += 1
        duplicates = []
        for prefix, page in zip(self.prefixes(tokens), page_ids, strict=False):
            if prefix not in self.pages:
                self.pages[prefix], self.locks[prefix] = page, 0
            elif self.pages[prefix] != page:
                duplicates.append(page)
            self.last_use[prefix] = self.clock
        return duplicates

    def lock(self, tokens, num_pages: int, delta: int) -> None:
        for prefix in self.prefixes(tokens)[:num_pages]:
            self.locks[prefix] += delta

    def evictable_leaves(self) -> list[tuple[int, ...]]:
        extended = {prefix[: -self.page_size] for prefix in self.pages}
        return [p for p in self.pages if p not in extended and self.locks[p] == 0]

    def num_evictable(self) -> int:
        return sum(1 for prefix in self.pages if self.locks[prefix] == 0)

    def evict(self, num_pages: int) -> None:
        for _ in range(num_pages):
            victim = min(self.evictable_leaves(), key=self.last_use.__getitem__)
            del self.pages[victim], self.last_use[victim], self.locks[victim]


@dataclass
class Request:
    tokens: list[int]
    prompt: list[int]
    matched: list[int]
    node: object
    own_pages: list[int]


def random_tokens(rng: random.Random, page_size: int) -> list[int]:
    """Pages drawn from a tiny pool so prefixes are shared, sometimes one token off mid-page."""
    pool = [pages_of(page_size, symbol) for symbol in range(3)]
    tokens = []
    for _ in range(rng.randint(0, 5)):
        page = list(rng.choice(pool))
        if rng.random() < 0.2:
            page[rng.randrange(page_size)] = rng.randrange(4)
        tokens += page
    return tokens + [rng.randrange(4) for _ in range(rng.randint(0, page_size - 1))]


def start_request(cache, allocator, ref, rng, active) -> None:
    tokens = random_tokens(rng, cache.page_size)
    prompt = tokens[: rng.randint(0, len(tokens))]
    match = cache.match_prefix(prompt)
    assert match.page_ids == ref.match(prompt)
    cache.lock(match.node)
    ref.lock(prompt, len(match.page_ids), +1)
    need = -(-len(tokens) // cache.page_size) - len(match.page_ids)
    if allocator.num_free < need:
        evict_and_compare(cache, ref, need - allocator.num_free)
    if allocator.num_free < need:  # could not admit: give the lock back
        cache.unlock(match.node)
        ref.lock(prompt, len(match.page_ids), -1)
        return
    own = allocator.allocate(need)
    active.append(Request(tokens, prompt, match.page_ids, match.node, own))


def finish_request(cache, allocator, ref, request) -> None:
    all_pages = request.matched + request.own_pages
    duplicates = cache.insert(request.tokens, all_pages)
    assert duplicates == ref.insert(request.tokens, all_pages)
    allocator.free(duplicates + all_pages[len(request.tokens) // cache.page_size :])
    cache.unlock(request.node)
    ref.lock(request.prompt, len(request.matched), -1)


def evict_and_compare(cache, ref, num_pages: int) -> None:
    evictable = ref.num_evictable()
    freed = cache.evict(num_pages)
    assert min(num_pages, evictable) <= freed <= evictable
    ref.evict(freed)  # the same pages, one at a time, must be the LRU choice


@pytest.mark.parametrize("seed", [0, 1])
@PAGE_SIZES
def test_random_operations_agree_with_a_brute_force_model(page_size, seed):
    rng = random.Random(seed)
    cache, allocator = make_cache(page_size, num_pages=25)
    ref = ReferenceCache(page_size)
    active: list[Request] = []
    for _ in range(300):
        op = rng.choices(["start", "finish", "match", "evict", "reset"], [4, 3, 2, 1, 0.1])[0]
        if op == "start":
            start_request(cache, allocator, ref, rng, active)
        elif op == "finish" and active:
            finish_request(cache, allocator, ref, active.pop(rng.randrange(len(active))))
        elif op == "match":
            tokens = random_tokens(rng, page_size)
            assert cache.match_prefix(tokens).page_ids == ref.match(tokens)
        elif op == "evict":
            evict_and_compare(cache, ref, rng.randint(1, 6))
        elif op == "reset":  # flush_cache: finish everything in flight first
            while active:
                finish_request(cache, allocator, ref, active.pop())
            cache.reset()
            ref = ReferenceCache(page_size)
        cache.check_invariants()
        assert tree_contents(cache) == ref.pages
        assert cache.evictable_pages == ref.num_evictable()
        held = sum(len(request.own_pages) for request in active)
        assert cache.cached_pages + allocator.num_free + held == allocator.capacity
