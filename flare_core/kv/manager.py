"""The KV-cache manager: the scheduler's one door to pages, state rows and the prefix cache.

Per request it holds a `KvRecord` (page table, block hashes, the depth registered in the prefix
cache, a prefix hit held while the request waits, the resume point it restores from) and all
the allocators behind it: the page allocator, the state-row allocator and the prefix cache with
its snapshot and logits rows. The scheduler decides what runs and who is preempted; it never
touches an allocator or the prefix cache itself.

Reserve, then commit. `obtainable(n)` says how many pages a step could have now (free ones,
then those the prefix cache would evict, then those freed by dropping the hits of blocked
waiting requests) without changing anything, so a candidate step the scheduler rejects costs
nothing; `extend` then takes them for the step it commits, evicting exactly what the count
assumed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flare_core.kv.pages import PageAllocator, StateRowAllocator, pages_for_tokens
from flare_core.kv.prefix import NO_HIT, PrefixCache, PrefixCacheStats, PrefixHit, ResumePoint, ResumeStorage


@dataclass(eq=False)
class KvRecord:
    """What the cache holds for one request. Only the manager changes it; the scheduler reads it."""

    hashes: list[bytes] = field(default_factory=list)  # prefix block hashes, grown lazily
    page_table: tuple[int, ...] = ()
    state_row: int | None = None  # held while the request is admitted
    generation: int = 0  # of the state row: a reused row's old outputs are stale
    cached_depth: int = 0  # leading pages registered in the prefix cache
    hit: PrefixHit | None = None  # a lookup held while waiting for pages, or until admitted
    restoring: ResumePoint | None = None  # pinned until the step carrying its restore completes


class KnownTokens(Protocol):
    """A request's tokens as far as the host knows them (prompt, then confirmed outputs)."""

    @property
    def num_known_tokens(self) -> int: ...

    def tokens_between(self, start: int, end: int) -> Sequence[int]: ...


@dataclass(frozen=True)
class Admission:
    """A request's state row, the tokens its prefix hit restores, and whether it resumes from a
    prefix-cache resume point, with the copies that restore it then: (cache tail page, the
    request's page), the snapshot row of its continuation state, and the stored logits of its
    whole prompt (an exact hit)."""

    state_row: int
    generation: int
    restored_tokens: int
    resumes: bool = False
    tail_copy: tuple[int, int] | None = None
    snapshot_row: int | None = None
    logits_row: int | None = None


class KvCacheManager:
    def __init__(self, pages: PageAllocator, state_rows: int, page_tokens: int, prefix: PrefixCache | None = None):
        if prefix is not None and prefix.page_tokens != page_tokens:
            raise ValueError(f"prefix cache page_tokens ({prefix.page_tokens}) must equal the "
                             f"cache manager's ({page_tokens})")
        self.page_tokens = page_tokens
        self.prefix = prefix
        self._pages = pages
        self._rows = StateRowAllocator(state_rows)
        self._records: dict[str, KvRecord] = {}

    # ---- what is held --------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self._pages.num_pages

    @property
    def free_pages(self) -> int:
        return self._pages.free_count

    @property
    def state_rows(self) -> int:
        return self._rows.num_rows

    @property
    def free_state_rows(self) -> int:
        return self._rows.free_count

    @property
    def cached_pages(self) -> int:
        return 0 if self.prefix is None else self.prefix.held_pages

    @property
    def request_page_refs(self) -> int:
        """References held on pages by anything but the prefix cache (page tables, hits held by
        waiting requests, reserved resume point copies)."""
        return self._pages.references - self.cached_pages

    @property
    def prefix_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's running totals (None without one)."""
        return None if self.prefix is None else self.prefix.stats

    @property
    def continuation_state(self) -> bool:
        """Whether only resume points (with their state snapshots) can be reused."""
        return self.prefix is not None and self.prefix.continuation_state

    # ---- requests ------------------------------------------------------------------------

    def open(self, request_id: str) -> KvRecord:
        """Start holding for `request_id` (it holds nothing yet)."""
        if request_id in self._records:
            raise ValueError(f"request_id {request_id!r} already has a cache record")
        record = self._records[request_id] = KvRecord()
        return record

    def close(self, request_id: str) -> None:
        """Forget `request_id`, which holds no state row: a hit it held is given back."""
        record = self._records.pop(request_id)
        assert record.state_row is None, "close() takes requests whose fence has passed"
        self._drop_hit(record)

    # ---- admission -----------------------------------------------------------------------

    def lookup(self, request_id: str, tokens: Sequence[int]) -> PrefixHit:
        """The longest reusable prefix of `tokens` for the waiting `request_id`, held until it is
        admitted or closed (one lookup per wait: later calls return the held hit)."""
        record = self._records[request_id]
        if record.hit is None and self.prefix is not None:
            record.hit = self.prefix.lookup(tokens, record.hashes)
        return record.hit or NO_HIT

    def admit(self, request_id: str, first_end: int, headroom: int) -> Admission | None:
        """A state row and pages for tokens [0, first_end) of `request_id` (its held hit's pages
        shared, the rest new), if a row is free and the pages can be had with `headroom` pages
        to spare; None, changing nothing, otherwise."""
        record = self._records[request_id]
        hit = record.hit or NO_HIT
        need = pages_for_tokens(first_end, self.page_tokens) - len(hit.pages)
        if not self._rows.free_count or self.obtainable(need + headroom, drop_hits=False) < need + headroom:
            return None
        self._make_free(need + headroom, drop_hits=False)
        row, generation = self._rows.allocate()
        record.state_row, record.generation = row, generation
        record.page_table = hit.pages + self._pages.allocate(need)
        record.cached_depth = len(hit.pages)
        record.hit = None
        resume_point = hit.resume_point
        if resume_point is None:
            return Admission(row, generation, hit.num_tokens)
        record.restoring = resume_point
        tail = None if resume_point.tail_page is None else (resume_point.tail_page, record.page_table[len(hit.pages)])
        return Admission(row, generation, hit.num_tokens, True, tail, resume_point.snapshot_row,
                         resume_point.logits_row if hit.exact else None)

    # ---- steps ---------------------------------------------------------------------------

    def obtainable(self, wanted: int, drop_hits: bool = True) -> int:
        """How many pages, up to `wanted`, `extend` could take now: free ones, then those the
        prefix cache evicts, then (with `drop_hits`) those the hits of waiting requests pin.
        Changes nothing."""
        free = self._pages.free_count
        if free >= wanted or self.prefix is None:
            return min(free, wanted)
        got = free + self.prefix.evictable_pages(wanted - free)
        if got < wanted and drop_hits:
            released, unpinned = self._waiting_hit_holds()
            got = free + self.prefix.evictable_pages(wanted - free, released, unpinned)
        return got

    def extend(self, grants: Mapping[str, int]) -> None:
        """Append `grants[request_id]` new pages to each request's page table (as many as
        `obtainable` counted)."""
        total = sum(grants.values())
        self._make_free(total, drop_hits=True)
        for request_id, count in grants.items():
            record = self._records[request_id]
            record.page_table += self._pages.allocate(count)

    def reserve_resume_point(self, request_id: str, tokens: Sequence[int], end: int,
                             prompt_end: bool) -> ResumeStorage | None:
        """Storage for a resume point of `request_id` at `end` (filled by the step that computes
        it), unless the cache has one there or nothing is worth keeping."""
        if self.prefix is None or self.prefix.has_resume_point(self._records[request_id].hashes, tokens, end):
            return None
        return self.prefix.reserve_resume_point(end, prompt_end)

    # ---- completion ----------------------------------------------------------------------

    def restored(self, request_id: str) -> None:
        """The step that restored `request_id` from its resume point has completed."""
        record = self._records[request_id]
        assert self.prefix is not None and record.restoring is not None
        self.prefix.unpin(record.restoring)
        record.restoring = None

    def save(self, request_id: str, prompt: Sequence[int], end: int, storage: ResumeStorage) -> None:
        """Register the resume point of `request_id` at `end`, whose storage a completed step filled."""
        record = self._records[request_id]
        assert self.prefix is not None
        self.prefix.record_resume_point(record.hashes, record.page_table, prompt, end, storage, record.cached_depth)
        record.cached_depth = max(record.cached_depth, end // self.page_tokens)

    def cache_written(self, request_id: str, tokens: KnownTokens, written: int) -> None:
        """Register `request_id`'s complete, fully known pages among its first `written` tokens
        (with continuation state only resume points register pages)."""
        if self.prefix is None or self.prefix.continuation_state:
            return
        record = self._records[request_id]
        depth = min(written, tokens.num_known_tokens) // self.page_tokens
        if depth > record.cached_depth:
            self.prefix.extend_hashes(record.hashes, tokens.tokens_between(0, depth * self.page_tokens))
            self.prefix.insert(record.hashes, record.page_table, depth, record.cached_depth)
            record.cached_depth = depth

    def release(self, request_id: str, tokens: KnownTokens, written: int) -> None:
        """Return `request_id`'s pages and state row (its fence has passed), registering what it
        wrote first. Its block hashes are kept for a later admission."""
        record = self._records[request_id]
        assert record.state_row is not None, f"request {request_id!r} holds no state row"
        self.cache_written(request_id, tokens, written)
        self._pages.release_all(record.page_table)
        if record.restoring is not None:
            assert self.prefix is not None
            self.prefix.unpin(record.restoring)
        self._rows.free(record.state_row)
        record.page_table, record.state_row, record.cached_depth, record.restoring = (), None, 0, None

    # ---- helpers -------------------------------------------------------------------------

    def _make_free(self, count: int, drop_hits: bool) -> None:
        if self._pages.free_count >= count or self.prefix is None:
            return
        self.prefix.evict_pages(count)
        if self._pages.free_count < count and drop_hits:
            for record in self._records.values():
                if record.state_row is None:
                    self._drop_hit(record)
            self.prefix.evict_pages(count)

    def _waiting_hit_holds(self) -> tuple[Counter[int], Counter[ResumePoint]]:
        """The page references and resume point pins the hits of waiting requests hold."""
        pages: Counter[int] = Counter()
        pins: Counter[ResumePoint] = Counter()
        for record in self._records.values():
            if record.state_row is None and record.hit is not None:
                pages.update(record.hit.pages)
                if record.hit.resume_point is not None:
                    pins[record.hit.resume_point] += 1
        return pages, pins

    def _drop_hit(self, record: KvRecord) -> None:
        if record.hit is not None:
            assert self.prefix is not None
            self.prefix.release_hit(record.hit)
            record.hit = None
