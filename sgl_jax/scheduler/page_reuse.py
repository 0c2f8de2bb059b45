"""Which cached KV pages a request may reuse: the rule the cache manager asks, supplied by the
decoding (scheduler/decoding.py).

The target's K/V at a position depend only on the tokens up to it, so plain decoding reuses
every page of a matched prefix (`ReuseEveryPage`). A draft whose cache slot pairs a position
with the token after it has a stricter rule (speculative/next_token_pages.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sgl_jax.scheduler.req import Req


class PageReuse(Protocol):
    def usable_pages(self, req: Req, pages: list[int]) -> int:
        """How many leading pages of a matched prefix `req` may read."""

    def replaces_held(self, req: Req) -> Callable[[int, int], bool] | None:
        """For the radix insert of `req`'s pages: whether its page at an index should replace
        the tree's copy `held` (None: never)."""

    def record(self, req: Req, pages: list[int], first: int, duplicates: set[int]) -> None:
        """`req` released its full pages `pages` (indices `first`...) into the radix tree;
        `duplicates` are those the tree already held a copy of."""


class ReuseEveryPage:
    """The target's rule: a matched prefix's pages are all valid."""

    def usable_pages(self, req: Req, pages: list[int]) -> int:
        return len(pages)

    def replaces_held(self, req: Req) -> None:
        return None

    def record(self, req: Req, pages: list[int], first: int, duplicates: set[int]) -> None:
        pass
