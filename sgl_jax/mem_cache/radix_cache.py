"""Radix prefix cache: requests that share a token prefix share the KV pages that hold it.

The tree is keyed by token ids in whole pages: every edge holds k * page_size token ids and the k
page ids whose KV they fill. Only full pages are cached; a partly filled last page stays with its
request. Plain host-side bookkeeping, no JAX.

How the scheduler uses it, per request:

1. ``match = cache.match_prefix(prompt)`` and at once ``cache.lock(match.node)``, before anything
   can call ``evict``: an unlocked handle may be evicted, and locking an evicted node raises.
   ``match.page_ids`` belong to the tree; the request reads them and never frees them. Matching
   ``prompt[:-1]`` leaves at least one token to compute, which the logits need.
2. Allocate the request's own pages for the rest (call ``evict`` first when the allocator is short).
3. On finish, with ``pages = match.page_ids + own_pages``: ``dups = cache.insert(tokens_with_kv,
   pages)``. The tree adopts the pages of every full page it did not hold yet. Pages it already
   holds at the same place (the matched ones) are recognised and not reported. ``dups`` are the
   caller's pages for full pages the tree already held under other page ids (two requests
   prefilled the same prompt concurrently): the caller frees them, and the pages past the full-page
   prefix, ``pages[len(tokens_with_kv) // page_size:]``, which insert never looks at. Then
   ``cache.unlock(match.node)``. Where the caller's copy of such a page is worth more than the
   tree's (``prefer_mine``: a speculative draft's K/V the tree's page lacks), an unlocked node
   takes the caller's page and ``dups`` holds the tree's old one instead.

Eviction removes least-recently-used unlocked leaves, a whole node at a time (so it may free more
than asked); a parent whose children are all gone becomes a leaf in turn. A lock counts on the node
and every ancestor, so nothing on a locked path is evicted. Recency is a counter bumped once per
match or insert, not wall time, so eviction order is deterministic.

Node handles stay valid while locked: splitting an edge puts the new node *above* the existing
one, so a handle keeps naming the same prefix. Nodes are never merged.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sgl_jax.mem_cache.page_allocator import NULL_PAGE, PageAllocator


class RadixNode:
    """A node and the edge leading to it from its parent.

    key: the edge's token ids, a whole number of pages; page_ids: one KV page per page of key.
    lock_count counts the locks held on this node or any descendant; direct_locks only this node's.
    """

    __slots__ = (
        "key",
        "page_ids",
        "parent",
        "children",
        "lock_count",
        "direct_locks",
        "last_access",
        "attached",
    )

    def __init__(
        self, key: tuple[int, ...], page_ids: list[int], parent: RadixNode | None, last_access: int
    ):
        self.key = key
        self.page_ids = page_ids
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}  # by the child's first page of tokens
        self.lock_count = 0
        self.direct_locks = 0
        self.last_access = last_access
        self.attached = True  # False once evicted or reset: the handle can no longer be locked

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)


@dataclass(frozen=True)
class PrefixMatch:
    page_ids: list[int]  # pages holding the matched prefix, in order
    num_tokens: int  # len(page_ids) * page_size
    node: RadixNode  # handle to lock / unlock


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.root = RadixNode((), [], None, 0)
        self._clock = 0
        self._owned: set[int] = set()  # every page id held by some node
        self._locked_pages = 0  # pages held by nodes with lock_count > 0

    @property
    def cached_pages(self) -> int:
        return len(self._owned)

    @property
    def evictable_pages(self) -> int:
        return len(self._owned) - self._locked_pages

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix in whole pages; marks the matched path as just used."""
        tokens = self._page_aligned(token_ids)
        now = self._tick()
        node, pos, pages = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + self.page_size])
            if child is None:
                break
            shared = self._shared_pages(child.key, tokens, pos)
            if shared < child.num_pages:
                child = self._split(child, shared)
            child.last_access = now
            pages.extend(child.page_ids)
            node, pos = child, pos + len(child.key)
        return PrefixMatch(pages, len(pages) * self.page_size, node)

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int],
               prefer_mine: Callable[[int, int], bool] | None = None) -> list[int]:
        """Cache the full-page prefix of token_ids. Returns the pages for the caller to free:
        its own where the tree already holds those prefix pages under other ids, except where
        `prefer_mine(index, held)` (the page's index in page_ids, the tree's id there) says the
        caller's copy is the better one and no lock covers the node (no request reads it):
        then the tree takes the caller's page and returns the one it held."""
        tokens = self._page_aligned(token_ids)
        num_pages = len(tokens) // self.page_size
        if len(page_ids) < num_pages:
            raise ValueError(
                f"{len(token_ids)} tokens fill {num_pages} full pages, got {len(page_ids)} page ids"
            )
        pages = [int(p) for p in page_ids[:num_pages]]
        if NULL_PAGE in pages or len(set(pages)) != len(pages):
            raise ValueError(f"page ids must be distinct and not the null page: {pages}")
        now = self._tick()
        node, pos, duplicates = self.root, 0, []
        while pos < len(tokens):
            at = pos // self.page_size  # index of the page starting at pos
            child = node.children.get(tokens[pos : pos + self.page_size])
            if child is None:
                self._adopt(node, tokens[pos:], pages[at:], now)
                break
            shared = self._shared_pages(child.key, tokens, pos)
            if shared < child.num_pages:
                child = self._split(child, shared)
            child.last_access = now
            theirs = pages[at : at + shared]
            for j, (mine, held) in enumerate(zip(theirs, list(child.page_ids), strict=True)):
                if mine == held:
                    continue
                freed = mine
                if prefer_mine is not None and child.lock_count == 0 and prefer_mine(at + j, held):
                    self._check_not_owned([mine])
                    child.page_ids[j], freed = mine, held
                    self._owned.symmetric_difference_update((mine, held))
                duplicates.append(freed)
            node, pos = child, pos + len(child.key)
        self._check_not_owned(duplicates)  # the caller would free pages the tree still uses
        return duplicates

    def lock(self, node: RadixNode) -> None:
        """Protect node and its ancestors from eviction until the matching unlock."""
        if not node.attached:
            raise ValueError("cannot lock a node that was evicted or reset")
        node.direct_locks += 1
        for n in self._path_to_root(node):
            if n.lock_count == 0:
                self._locked_pages += n.num_pages
            n.lock_count += 1

    def unlock(self, node: RadixNode) -> None:
        if node.direct_locks == 0:
            raise ValueError("unlock without a matching lock on this node")
        node.direct_locks -= 1
        for n in self._path_to_root(node):
            n.lock_count -= 1
            if n.lock_count == 0:
                self._locked_pages -= n.num_pages

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages if that many are evictable; returns the number freed."""
        tie_break = itertools.count()  # keeps the heap from ever comparing nodes
        leaves = [(n.last_access, next(tie_break), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            if self._evictable(parent):
                heapq.heappush(leaves, (parent.last_access, next(tie_break), parent))
        return freed

    def reset(self) -> None:
        """Drop every node and free its pages (flush_cache); refuses while any lock is held."""
        if self.root.lock_count:
            raise RuntimeError(f"cannot reset the radix cache: {self.root.lock_count} locks held")
        for node in self._nodes():
            node.attached = node is self.root
        self.allocator.free(sorted(self._owned))
        self._owned.clear()
        self.root.children.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if the tree's structure or counters are inconsistent (for tests)."""
        seen: set[int] = set()
        locked_pages = 0
        for node in self._nodes():
            if node is not self.root and (
                not node.key or len(node.key) != len(node.page_ids) * self.page_size
            ):
                raise AssertionError(f"edge of {len(node.key)} tokens holds {node.num_pages} pages")
            for first_page, child in node.children.items():
                if child.parent is not node or child.key[: self.page_size] != first_page:
                    raise AssertionError("child is filed under the wrong parent or key")
            expected_locks = node.direct_locks + sum(c.lock_count for c in node.children.values())
            if node.lock_count != expected_locks:
                raise AssertionError(f"lock_count {node.lock_count} != {expected_locks}")
            if seen.intersection(node.page_ids) or NULL_PAGE in node.page_ids:
                raise AssertionError(f"page owned twice or null page cached: {node.page_ids}")
            seen.update(node.page_ids)
            locked_pages += node.num_pages if node.lock_count else 0
        if seen != self._owned or locked_pages != self._locked_pages:
            raise AssertionError("page counters disagree with the tree")

    # --- helpers ---

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _page_aligned(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        full = len(token_ids) // self.page_size * self.page_size
        return tuple(int(t) for t in token_ids[:full])

    def _shared_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """Whole pages that key shares with tokens[pos:]."""
        limit = min(len(key), len(tokens) - pos)
        i = 0
        while i < limit and key[i] == tokens[pos + i]:
            i += 1
        return i // self.page_size

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut node's edge after num_pages pages; returns the new upper node (node keeps the tail,
        so handles to it still name the same prefix)."""
        cut = num_pages * self.page_size
        upper = RadixNode(node.key[:cut], node.page_ids[:num_pages], node.parent, node.last_access)
        upper.lock_count = node.lock_count  # node's locks count on every ancestor
        node.parent.children[upper.key[: self.page_size]] = upper
        node.key, node.page_ids, node.parent = node.key[cut:], node.page_ids[num_pages:], upper
        upper.children[node.key[: self.page_size]] = node
        return upper

    def _adopt(self, parent: RadixNode, key: tuple[int, ...], pages: list[int], now: int) -> None:
        self._check_not_owned(pages)  # else a page would be owned by two nodes
        parent.children[key[: self.page_size]] = RadixNode(key, pages, parent, now)
        self._owned.update(pages)

    def _check_not_owned(self, pages: list[int]) -> None:
        """The caller's pages must be its own: tree pages belong only at their cached place."""
        owned = self._owned.intersection(pages)
        if owned:
            raise ValueError(f"pages {sorted(owned)} are already held by the tree elsewhere")

    def _remove_leaf(self, leaf: RadixNode) -> int:
        del leaf.parent.children[leaf.key[: self.page_size]]
        leaf.parent, leaf.attached = None, False
        self.allocator.free(leaf.page_ids)
        self._owned.difference_update(leaf.page_ids)
        return leaf.num_pages

    def _evictable(self, node: RadixNode) -> bool:
        return node is not self.root and not node.children and node.lock_count == 0

    def _path_to_root(self, node: RadixNode) -> Iterator[RadixNode]:
        while node is not None:
            yield node
            node = node.parent

    def _nodes(self) -> Iterator[RadixNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
