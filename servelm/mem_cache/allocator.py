"""Paged KV memory bookkeeping: which pages of the KV pool are free.

The KV pool holds `num_pages` pages of `page_size` tokens each. Token slot `s`
lives in page `s // page_size`, so a request whose KV occupies `pages` keeps
position `p` at slot `pages[p // P] * P + p % P`. This module only tracks page
ids (plain integers); the tensors that hold the actual K/V live in the model
runner and are indexed by the slots computed here.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

__all__ = ["PageAllocator", "pages_of", "slots_for"]


class PageAllocator:
    """Hands out KV pages, lowest free id first.

    Lowest-first keeps allocation deterministic (tests and TP ranks agree on
    ids without communicating) and keeps live pages dense at the low end of
    the pool. A min-heap gives O(log n) per page; a bytearray of free flags
    makes double-free and ownership checks O(1).
    """

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.num_pages: int = num_pages
        self.page_size: int = page_size
        self._free_heap: list[int] = []
        self._is_free = bytearray()
        self.reset()

    @property
    def num_free_pages(self) -> int:
        """Pages available to `alloc`."""
        return len(self._free_heap)

    @property
    def num_used_pages(self) -> int:
        """Pages handed out and not yet freed (owned by requests or the prefix cache)."""
        return self.num_pages - len(self._free_heap)

    @property
    def num_tokens(self) -> int:
        """Capacity of the pool in tokens."""
        return self.num_pages * self.page_size

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` pages, lowest ids first; None (and nothing taken) if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages: {n}")
        if n > len(self._free_heap):
            return None
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool.

        Raises ValueError, freeing nothing, if any page is out of range, already
        free, or listed twice: such a call is a bookkeeping bug that would
        otherwise let two requests write the same KV slots.
        """
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            if not (0 <= p < self.num_pages):
                raise ValueError(f"page {p} is out of range [0, {self.num_pages})")
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            self._is_free[p] = 1
            heapq.heappush(self._free_heap, p)

    def is_free(self, page: int) -> bool:
        """Whether `page` is currently in the free pool."""
        if not (0 <= page < self.num_pages):
            raise ValueError(f"page {page} is out of range [0, {self.num_pages})")
        return bool(self._is_free[page])

    def reset(self) -> None:
        """Mark every page free (the caller must drop every reference it holds)."""
        self._free_heap = list(range(self.num_pages))  # sorted, hence already a valid heap
        self._is_free = bytearray(b"\x01") * self.num_pages

    def __repr__(self) -> str:
        return (f"PageAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"free={self.num_free_pages})")


def slots_for(pages: Sequence[int], page_size: int, start: int, end: int) -> list[int]:
    """Token slots of positions [start, end) for a request whose KV lives in `pages`."""
    if not (0 <= start <= end):
        raise ValueError(f"bad position range [{start}, {end})")
    if end > len(pages) * page_size:
        raise ValueError(f"positions up to {end} need {-(-end // page_size)} pages, only {len(pages)} given")
    P = page_size
    return [pages[p // P] * P + p % P for p in range(start, end)]


def pages_of(slots: Sequence[int], page_size: int) -> list[int]:
    """Page ids of a slot list that starts on a page boundary (the last page may be partial)."""
    pages = [s // page_size for s in slots[::page_size]]
    if page_size > 1:
        for s in slots[::page_size]:
            if s % page_size:
                raise ValueError(f"slot list is not page aligned: slot {s} starts a page of size {page_size}")
    return pages
