"""The page-reuse rule of drafts whose cache slot pairs a position with the next token.

EAGLE's heads keep at draft KV slot j what they computed from the target's features at j and
token j + 1, so a cached page's last slot holds what the draft computed with the token after
the page of the request that cached it. Recorded per page, a request with a draft reuses a
page only if it continues alike; one without a draft reads only the target's K/V, so every
page of its matched prefix is valid to it.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_jax.scheduler.req import Req
from sgl_jax.speculative.request_state import DraftStates


class NextTokenPages:
    """scheduler.page_reuse.PageReuse for drafts that pair slot j with token j + 1."""

    def __init__(self, states: DraftStates, page_size: int):
        self.states = states
        self.page_size = page_size
        self.next_token_of_page: dict[int, int] = {}

    def usable_pages(self, req: Req, pages: list[int]) -> int:
        """Up to the first page whose last draft slot was computed with another next token."""
        if not self.states[req].drafting:
            return len(pages)
        token_ids = req.all_ids
        for i, page in enumerate(pages):
            if self.next_token_of_page.get(page) != token_ids[(i + 1) * self.page_size]:
                return i
        return len(pages)

    def replaces_held(self, req: Req) -> Callable[[int, int], bool] | None:
        """A request's page replaces the tree's copy `held` that has no record (its draft
        slots were never filled: it was computed without a draft) where the request's draft
        filled its own."""
        state = self.states[req]
        if not state.drafting:
            return None
        draft_len = state.draft_len(req)
        return lambda index, held: (held not in self.next_token_of_page
                                    and (index + 1) * self.page_size <= draft_len)

    def record(self, req: Req, pages: list[int], first: int, duplicates: set[int]) -> None:
        """The next token of every page the request computed that the tree now holds. A page
        the draft had not filled (plain rounds left it behind, or the request had no draft)
        gets no record: no request reuses it."""
        token_ids, draft_len = req.all_ids, self.states[req].draft_len(req)
        for i, page in enumerate(pages, start=first):
            if page in duplicates:
                continue
            after = (i + 1) * self.page_size
            if after <= draft_len:
                self.next_token_of_page[page] = token_ids[after]
            else:
                self.next_token_of_page.pop(page, None)
