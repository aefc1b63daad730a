"""Page and state-row allocators: the memory accounting under the prefix cache and the scheduler.

Pages hold `page_tokens` logical tokens of every paged store of a cache scheme. A page can be
referenced by several owners at once (a live request's page table, the prefix cache, a pending
resume point copy); it returns to the free list when its last reference is released.

State rows are fixed-size per-request rows of continuation state. A scheme without state still
uses them: a row (0 bytes) is what each live request holds, so max_concurrency counts rows.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable


class AllocatorExhausted(RuntimeError):
    """Raised when an allocator has fewer free entries than requested."""


class PagesExhausted(AllocatorExhausted):
    """Raised when more pages are requested than are free."""


class RowsExhausted(AllocatorExhausted):
    """Raised when a row is requested and every row is in use."""


def pages_for_tokens(num_tokens: int, page_tokens: int) -> int:
    """Pages needed to hold positions [0, num_tokens)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    return -(-num_tokens // page_tokens)


def request_page_need(prompt_len: int, max_tokens: int, page_tokens: int) -> int:
    """Pages a request needs at its largest: every prompt token and every generated token except
    the last one is written to the cache (the last sampled token is never fed back)."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return pages_for_tokens(prompt_len + max_tokens - 1, page_tokens)


class PageAllocator:
    """Reference-counted page ids 0..num_pages-1.

    Freed pages go to the back of the free queue, so the page freed longest ago is reused first
    (deterministic, and it keeps recently freed pages readable for debugging)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"PageAllocator num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._references = 0  # sum of the refcounts, so holders can be accounted in O(1)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def references(self) -> int:
        """References held on all pages together (a page shared by two owners counts twice)."""
        return self._references

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refcounts[page]

    def allocate(self, count: int) -> tuple[int, ...]:
        """Take `count` free pages, each with one reference held by the caller."""
        if count < 0:
            raise ValueError(f"page count must be >= 0, got {count}")
        if count > len(self._free):
            raise PagesExhausted(f"requested {count} pages but only {len(self._free)} of "
                                 f"{self.num_pages} are free")
        pages = tuple(self._free.popleft() for _ in range(count))
        for page in pages:
            self._refcounts[page] = 1
        self._references += count
        return pages

    def retain(self, page: int) -> None:
        """Add a reference to an allocated page (sharing it)."""
        self._check_id(page)
        if self._refcounts[page] == 0:
            raise ValueError(f"page {page} is free; only an allocated page can be shared")
        self._refcounts[page] += 1
        self._references += 1

    def release(self, page: int) -> None:
        """Drop one reference; the page becomes free when none are left."""
        self._check_id(page)
        if self._refcounts[page] == 0:
            raise ValueError(f"page {page} is already free (double release)")
        self._refcounts[page] -= 1
        self._references -= 1
        if self._refcounts[page] == 0:
            self._free.append(page)

    def release_all(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.release(page)

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page} is outside 0..{self.num_pages - 1}")


class StateRowAllocator:
    """Fixed rows of `row_bytes` each (0 for a scheme without continuation state, where a row is
    just held by a live request). Each allocation bumps the row's generation, so a handle (row, generation) taken
    for one request never matches a later request that reuses the row."""

    def __init__(self, num_rows: int, row_bytes: int = 0) -> None:
        if num_rows < 0:
            raise ValueError(f"StateRowAllocator num_rows must be >= 0, got {num_rows}")
        if row_bytes < 0:
            raise ValueError(f"StateRowAllocator row_bytes must be >= 0, got {row_bytes}")
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self._generations = [0] * num_rows
        self._in_use = [False] * num_rows
        # Lowest free row first keeps live rows packed at the front of the state tensors.
        self._free = list(range(num_rows))

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_rows - len(self._free)

    @property
    def total_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    def generation(self, row: int) -> int:
        self._check_id(row)
        return self._generations[row]

    def allocate(self) -> tuple[int, int]:
        """Take the lowest free row; returns (row, generation)."""
        if not self._free:
            raise RowsExhausted(f"all {self.num_rows} state rows are in use")
        row = heapq.heappop(self._free)
        self._in_use[row] = True
        self._generations[row] += 1
        return row, self._generations[row]

    def free(self, row: int) -> None:
        self._check_id(row)
        if not self._in_use[row]:
            raise ValueError(f"state row {row} is already free (double free)")
        self._in_use[row] = False
        heapq.heappush(self._free, row)

    def _check_id(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise ValueError(f"state row {row} is outside 0..{self.num_rows - 1}")
