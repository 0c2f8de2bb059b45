"""Host-side allocation of KV pages. Page 0 is never handed out: padding tokens write there."""

from __future__ import annotations

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised when a request needs more KV pages than are free."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # a stack: low ids first
        self._in_use: set[int] = set()

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPagesError(f"need {count} KV pages but only {len(self._free)} are free")
        pages = [self._free.pop() for _ in range(count)]
        self._in_use.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._in_use:
                raise ValueError(f"page {page} is not allocated (double free?)")
            self._in_use.remove(page)
            self._free.append(page)
