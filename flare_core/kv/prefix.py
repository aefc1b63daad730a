"""Prefix cache: chained block hashes, a tree of immutable shared pages, and resume points.

Hashing. The unit is one complete page of `page_tokens` tokens. Block i of a token sequence
hashes to blake2b(digest_size=16) over (hash of block i-1 || token ids of block i as
little-endian uint32); block 0 chains from the 32-byte model/recipe identity. Equal hashes mean
equal identity and equal tokens from position 0, so a hash names one page's content.

Tree. Each cached block owns one allocator reference on its page and links to its parent block.
A block is pinned while any other reference to its page exists (a live request's page table; a
request releases its pages only after the step that last used them has completed, so pins also
cover in-flight GPU use). Only unpinned leaves are evicted, least recently used first; evicting a
leaf can turn its parent into a leaf.

Resume points. A resume point at token endpoint E hangs off the block covering
[0, floor(E/P)*P) (or the root when E < P) and is keyed by the tail tokens [floor(E/P)*P, E).
It may hold:
  * tail_page: a cache-owned copy of the partial last page (positions floor(E/P)*P .. E-1).
    Partial pages are never shared in place because their owner keeps writing into them.
  * snapshot_row: a snapshot row holding the continuation-state row taken at exactly E
    (schemes with continuation state only; the runtime copies the row, the cache owns the snapshot row).
  * logits_row: a row holding the next-token logits at E, recorded at the prompt end. A later
    request whose whole prompt equals these E tokens is an exact hit: it restores pages, tail and
    state, samples its first token from the stored logits with its own sampling parameters, and
    recomputes nothing.
A resume point is evicted like a leaf (LRU, never while a restore from it is in flight) and frees
its tail page and rows.

Reuse rule (`lookup`). With no continuation state every complete-page boundary <= len-1 is
reusable (one prompt token is recomputed to get logits), and a resume point's tail page extends a
hit past the last complete page. With continuation state only resume point endpoints are
reusable, because the state is known only there. An endpoint equal to the prompt length is
reusable only through stored logits.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from flare_core.kv.pages import PageAllocator, StateRowAllocator

IDENTITY_BYTES = 32
BLOCK_HASH_BYTES = 16


def block_hash(parent: bytes, block: Sequence[int]) -> bytes:
    """Hash of one block chained from its parent's hash (or the identity for block 0)."""
    try:
        data = struct.pack(f"<{len(block)}I", *block)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in 0..2**32-1 to be hashed: {exc}") from None
    digest = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES)
    digest.update(parent)
    digest.update(data)
    return digest.digest()


def extend_block_hashes(identity: bytes, hashes: list[bytes], tokens: Sequence[int],
                        page_tokens: int) -> None:
    """Append to `hashes` the chained hashes of the complete blocks of `tokens` not yet hashed.
    `hashes` must already hold the hashes of a prefix of the same tokens."""
    parent = hashes[-1] if hashes else identity
    for index in range(len(hashes), len(tokens) // page_tokens):
        parent = block_hash(parent, tokens[index * page_tokens:(index + 1) * page_tokens])
        hashes.append(parent)


class _Block:
    """One cached complete page. The root block stands for the identity and has no page."""

    __slots__ = ("hash", "parent", "depth", "page", "children", "resume_points", "last_used", "evicted")

    def __init__(self, hash_: bytes, parent: _Block | None, depth: int, page: int, last_used: int) -> None:
        self.hash = hash_
        self.parent = parent
        self.depth = depth
        self.page = page
        self.children = 0
        self.resume_points: dict[tuple[int, ...], ResumePoint] = {}
        self.last_used = last_used
        self.evicted = False

    @property
    def is_leaf(self) -> bool:
        return self.children == 0 and not self.resume_points


class ResumePoint:
    """A reusable endpoint; see the module docstring for what each field holds."""

    __slots__ = ("end", "tail", "tail_page", "snapshot_row", "logits_row", "holder", "pins",
                 "last_used", "evicted")

    def __init__(self, end: int, tail: tuple[int, ...], slots: ResumeStorage, holder: _Block,
                 last_used: int) -> None:
        self.end = end
        self.tail = tail
        self.tail_page = slots.tail_page
        self.snapshot_row = slots.snapshot_row
        self.logits_row = slots.logits_row
        self.holder = holder
        self.pins = 0
        self.last_used = last_used
        self.evicted = False

    def __repr__(self) -> str:
        return (f"ResumePoint(end={self.end}, tail_page={self.tail_page}, "
                f"snapshot_row={self.snapshot_row}, logits_row={self.logits_row}, pins={self.pins})")


@dataclass(frozen=True)
class ResumeStorage:
    """Storage reserved for one resume point before the step that fills it runs."""

    tail_page: int | None
    snapshot_row: int | None
    logits_row: int | None


@dataclass(frozen=True)
class PrefixHit:
    """What a lookup found. The caller holds one reference on each page and a pin on the
    resume point until it calls `PrefixCache.release_hit` (on giving up) or, for the resume point,
    `PrefixCache.unpin` (once the restore copies have run)."""

    num_tokens: int                 # positions [0, num_tokens) are restored; work resumes here
    pages: tuple[int, ...]          # shared complete pages for [0, len(pages) * page_tokens)
    resume_point: ResumePoint | None   # tail page / state snapshot / logits to restore, if any
    exact: bool                     # the whole prompt is restored and logits give the next token


NO_HIT = PrefixHit(0, (), None, False)


@dataclass(frozen=True)
class PrefixCacheStats:
    lookups: int
    hits: int
    reused_tokens: int
    evictions: int
    cached_blocks: int
    resume_points: int


_Item = TypeVar("_Item", _Block, ResumePoint)


class _LruHeap(Generic[_Item]):
    """Min-heap by last_used with lazy deletion: an entry is current only while the item's
    last_used still equals the stamp it was pushed with and the caller's test accepts it."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, _Item]] = []
        self._serial = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[tuple[int, int, _Item]]:
        """The heap's entries (stale ones included), to copy for a dry run."""
        return self._entries

    def push(self, item: _Item) -> None:
        heapq.heappush(self._entries, (item.last_used, next(self._serial), item))

    def peek(self, is_candidate: Callable[[_Item], bool]) -> _Item | None:
        while self._entries:
            stamp, _, item = self._entries[0]
            if stamp == item.last_used and is_candidate(item):
                return item
            heapq.heappop(self._entries)
        return None

    def pop(self) -> _Item:
        return heapq.heappop(self._entries)[2]

    def rebuild(self, items: Iterable[_Item]) -> None:
        self._entries = [(item.last_used, next(self._serial), item) for item in items]
        heapq.heapify(self._entries)


class PrefixCache:
    """Shared prefix pages and resume points over one PageAllocator.

    `snapshot_rows` and `logits_rows` size the runtime's snapshot buffers (continuation-state
    rows and next-token logits rows); the cache hands out and frees their indices."""

    def __init__(self, identity: bytes, pages: PageAllocator, page_tokens: int = 64, *,
                 continuation_state: bool = False, snapshot_rows: int = 0,
                 logits_rows: int = 0) -> None:
        if not isinstance(identity, bytes) or len(identity) != IDENTITY_BYTES:
            raise ValueError(f"PrefixCache identity must be {IDENTITY_BYTES} bytes, "
                             f"got {len(identity) if isinstance(identity, bytes) else type(identity).__name__}")
        if page_tokens < 1:
            raise ValueError(f"PrefixCache page_tokens must be >= 1, got {page_tokens}")
        if continuation_state and snapshot_rows < 1:
            raise ValueError("PrefixCache snapshot_rows must be >= 1 when the cache scheme has "
                             f"continuation state (only resume points are reusable), got {snapshot_rows}")
        if not continuation_state and snapshot_rows:
            raise ValueError(f"PrefixCache snapshot_rows must be 0 without continuation state, got {snapshot_rows}")
        self.identity = identity
        self.page_tokens = page_tokens
        self.continuation_state = continuation_state
        self._pages = pages
        self._snapshots = StateRowAllocator(snapshot_rows)
        self._logits = StateRowAllocator(logits_rows)
        self._tick = 0
        self._root = _Block(identity, None, 0, -1, 0)
        self._blocks: dict[bytes, _Block] = {}
        self._block_lru: _LruHeap[_Block] = _LruHeap()
        self._resume_point_lru: _LruHeap[ResumePoint] = _LruHeap()
        self._num_resume_points = 0
        self._tail_pages = 0  # resume points holding a tail page
        self._lookups = self._hits = self._reused_tokens = self._evictions = 0

    @property
    def snapshot_rows(self) -> int:
        return self._snapshots.num_rows

    @property
    def logits_rows(self) -> int:
        return self._logits.num_rows

    @property
    def free_snapshot_rows(self) -> int:
        return self._snapshots.free_count

    @property
    def free_logits_rows(self) -> int:
        return self._logits.free_count

    @property
    def held_pages(self) -> int:
        """Pages the cache holds a reference on: one per cached block and resume point tail page."""
        return len(self._blocks) + self._tail_pages

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._lookups, self._hits, self._reused_tokens, self._evictions,
                                len(self._blocks), self._num_resume_points)

    def extend_hashes(self, hashes: list[bytes], tokens: Sequence[int]) -> None:
        extend_block_hashes(self.identity, hashes, tokens, self.page_tokens)

    # ---- lookup -------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], hashes: list[bytes]) -> PrefixHit:
        """Longest reusable prefix of `tokens` (see the module docstring). `hashes` caches the
        caller's block hashes and is extended here. The returned pages are retained and the
        resume point pinned for the caller."""
        total = len(tokens)
        if total < 1:
            raise ValueError("lookup needs at least one token")
        self.extend_hashes(hashes, tokens)
        chain: list[_Block] = []
        for digest in hashes[:total // self.page_tokens]:
            block = self._blocks.get(digest)
            if block is None:
                break
            chain.append(block)

        best_end = 0 if self.continuation_state else min(len(chain), (total - 1) // self.page_tokens) * self.page_tokens
        best: ResumePoint | None = None
        for depth in range(len(chain), -1, -1):
            base = depth * self.page_tokens
            if base + self.page_tokens - 1 <= best_end:
                break  # resume points at this depth or shallower end before best_end
            holder = chain[depth - 1] if depth else self._root
            for tail, resume_point in holder.resume_points.items():
                end = base + len(tail)
                if end <= best_end or end > total or tuple(tokens[base:end]) != tail:
                    continue
                if end == total and resume_point.logits_row is None:
                    continue
                best_end, best = end, resume_point
            if best is not None:
                break

        self._lookups += 1
        if best_end == 0:
            return NO_HIT
        self._hits += 1
        self._reused_tokens += best_end
        used = chain[:best_end // self.page_tokens]
        self._tick += 1
        for block in used:
            self._pages.retain(block.page)
            self._touch_block(block)
        if best is not None:
            best.pins += 1
            self._touch_resume_point(best)
        self._compact()
        return PrefixHit(best_end, tuple(block.page for block in used), best, best_end == total)

    def release_hit(self, hit: PrefixHit) -> None:
        """Give back a hit that will not be used."""
        self._pages.release_all(hit.pages)
        if hit.resume_point is not None:
            self.unpin(hit.resume_point)

    def unpin(self, resume_point: ResumePoint) -> None:
        if resume_point.pins < 1:
            raise ValueError(f"{resume_point!r} is not pinned")
        resume_point.pins -= 1

    # ---- insertion ----------------------------------------------------------------------

    def insert(self, hashes: Sequence[bytes], page_table: Sequence[int], depth: int,
               known_depth: int = 0) -> None:
        """Register complete pages [0, depth) of a request (page_table[i] holds block i).
        Blocks below `known_depth` were registered earlier by the same request and are still
        cached (its references pin them). A block already cached keeps its existing page."""
        if depth > len(hashes) or depth > len(page_table):
            raise ValueError(f"insert depth {depth} exceeds hashes ({len(hashes)}) or page table "
                             f"({len(page_table)})")
        if known_depth and hashes[known_depth - 1] not in self._blocks:
            known_depth = 0
        parent = self._blocks[hashes[known_depth - 1]] if known_depth else self._root
        self._tick += 1
        for index in range(known_depth, depth):
            block = self._blocks.get(hashes[index])
            if block is None:
                block = _Block(hashes[index], parent, index + 1, page_table[index], self._tick)
                self._pages.retain(block.page)
                self._blocks[block.hash] = block
                parent.children += 1
                self._block_lru.push(block)
            else:
                self._touch_block(block)
            parent = block
        self._compact()

    # ---- resume points --------------------------------------------------------------------

    def has_resume_point(self, hashes: list[bytes], tokens: Sequence[int], end: int) -> bool:
        holder = self._holder(hashes, tokens, end)
        return holder is not None and self._tail(tokens, end) in holder.resume_points

    def reserve_resume_point(self, end: int, prompt_end: bool) -> ResumeStorage | None:
        """Reserve storage for a resume point at `end`, or None when there is nothing worth
        storing (no continuation state and no logits to keep) or required storage cannot be
        freed. Evicts least recently used entries to make room."""
        unaligned = end % self.page_tokens != 0
        want_logits = prompt_end and self._logits.num_rows > 0
        if not self.continuation_state and not want_logits:
            return None
        state = None
        if self.continuation_state:
            state = self._take_row(self._snapshots, "snapshot_row")
            if state is None:
                return None
        tail = None
        if unaligned:
            self.evict_pages(1)
            if self._pages.free_count == 0:
                if state is not None:
                    self._snapshots.free(state)
                return None
            tail = self._pages.allocate(1)[0]
        logits = self._take_row(self._logits, "logits_row") if want_logits else None
        if state is None and logits is None and not unaligned:
            return None
        return ResumeStorage(tail, state, logits)

    def discard(self, slots: ResumeStorage) -> None:
        """Free a reservation that will not be recorded."""
        if slots.tail_page is not None:
            self._pages.release(slots.tail_page)
        if slots.snapshot_row is not None:
            self._snapshots.free(slots.snapshot_row)
        if slots.logits_row is not None:
            self._logits.free(slots.logits_row)

    def record_resume_point(self, hashes: list[bytes], page_table: Sequence[int], tokens: Sequence[int],
                          end: int, slots: ResumeStorage, known_depth: int = 0) -> None:
        """Register the pages under `end` and a resume point whose reserved storage has now been
        filled by the runtime. A resume point already present keeps its storage; this one is freed."""
        depth = end // self.page_tokens
        self.extend_hashes(hashes, tokens[:end])
        self.insert(hashes, page_table, depth, known_depth)
        holder = self._blocks[hashes[depth - 1]] if depth else self._root
        tail = self._tail(tokens, end)
        existing = holder.resume_points.get(tail)
        if existing is not None:
            self.discard(slots)
            self._tick += 1
            self._touch_resume_point(existing)
            return
        self._tick += 1
        resume_point = ResumePoint(end, tail, slots, holder, self._tick)
        holder.resume_points[tail] = resume_point
        self._num_resume_points += 1
        self._tail_pages += resume_point.tail_page is not None
        self._resume_point_lru.push(resume_point)

    # ---- eviction -----------------------------------------------------------------------

    def evict_pages(self, wanted_free: int) -> None:
        """Evict least recently used unpinned leaves and resume points until the allocator has
        `wanted_free` free pages or nothing more can be evicted."""
        pinned_blocks: list[_Block] = []
        pinned_resume_points: list[ResumePoint] = []
        while self._pages.free_count < wanted_free:
            block = self._block_lru.peek(self._is_evictable_block)
            if block is not None and self._pages.refcount(block.page) > 1:
                pinned_blocks.append(self._block_lru.pop())
                continue
            resume_point = self._resume_point_lru.peek(lambda c: not c.evicted)
            if resume_point is not None and resume_point.pins:
                pinned_resume_points.append(self._resume_point_lru.pop())
                continue
            if block is None and resume_point is None:
                break
            if resume_point is not None and (block is None or resume_point.last_used <= block.last_used):
                self._resume_point_lru.pop()
                self._evict_resume_point(resume_point)
            else:
                assert block is not None
                self._block_lru.pop()
                self._evict_block(block)
        for block in pinned_blocks:
            self._block_lru.push(block)
        for resume_point in pinned_resume_points:
            self._resume_point_lru.push(resume_point)

    def evictable_pages(self, wanted: int, released: Mapping[int, int] | None = None,
                        unpinned: Mapping[ResumePoint, int] | None = None) -> int:
        """How many pages, up to `wanted`, `evict_pages` would free now; nothing changes (a dry
        run of the same order). `released`: references on pages and `unpinned`: pins on resume
        points to count as given back first (the hits of blocked waiting requests)."""
        released, unpinned = released or {}, unpinned or {}
        return _dry_run_eviction(self._block_lru.entries, self._resume_point_lru.entries, self._root,
                                 lambda page: self._pages.refcount(page) - released.get(page, 0),
                                 lambda point: point.pins - unpinned.get(point, 0), wanted)

    def _take_row(self, rows: StateRowAllocator, slot_field: str) -> int | None:
        """A free row of `rows`, evicting the least recently used unpinned resume point holding
        one when none is free."""
        if rows.num_rows == 0:
            return None
        skipped: list[ResumePoint] = []
        while rows.free_count == 0:
            resume_point = self._resume_point_lru.peek(lambda c: not c.evicted)
            if resume_point is None:
                break
            self._resume_point_lru.pop()
            if resume_point.pins or getattr(resume_point, slot_field) is None:
                skipped.append(resume_point)
            else:
                self._evict_resume_point(resume_point)
        for resume_point in skipped:
            self._resume_point_lru.push(resume_point)
        return rows.allocate()[0] if rows.free_count else None

    def _evict_block(self, block: _Block) -> None:
        block.evicted = True
        del self._blocks[block.hash]
        self._pages.release(block.page)
        self._evictions += 1
        parent = block.parent
        assert parent is not None
        parent.children -= 1
        if parent is not self._root and parent.is_leaf:
            self._block_lru.push(parent)

    def _evict_resume_point(self, resume_point: ResumePoint) -> None:
        resume_point.evicted = True
        holder = resume_point.holder
        del holder.resume_points[resume_point.tail]
        self._num_resume_points -= 1
        self._tail_pages -= resume_point.tail_page is not None
        self.discard(ResumeStorage(resume_point.tail_page, resume_point.snapshot_row, resume_point.logits_row))
        self._evictions += 1
        if holder is not self._root and holder.is_leaf:
            self._block_lru.push(holder)

    # ---- helpers ------------------------------------------------------------------------

    @staticmethod
    def _is_evictable_block(block: _Block) -> bool:
        return not block.evicted and block.is_leaf

    def _touch_block(self, block: _Block) -> None:
        block.last_used = self._tick
        if block.is_leaf:
            self._block_lru.push(block)

    def _touch_resume_point(self, resume_point: ResumePoint) -> None:
        resume_point.last_used = self._tick
        self._resume_point_lru.push(resume_point)

    def _holder(self, hashes: list[bytes], tokens: Sequence[int], end: int) -> _Block | None:
        depth = end // self.page_tokens
        if depth == 0:
            return self._root
        self.extend_hashes(hashes, tokens[:end])
        return self._blocks.get(hashes[depth - 1])

    def _tail(self, tokens: Sequence[int], end: int) -> tuple[int, ...]:
        return tuple(tokens[end // self.page_tokens * self.page_tokens:end])

    def _compact(self) -> None:
        # Touches push fresh heap entries; drop the stale ones when they dominate.
        if len(self._block_lru) > 2 * len(self._blocks) + 64:
            self._block_lru.rebuild(b for b in self._blocks.values() if b.is_leaf)
        if len(self._resume_point_lru) > 2 * self._num_resume_points + 64:
            self._resume_point_lru.rebuild(c for b in [self._root, *self._blocks.values()]
                                         for c in b.resume_points.values())


def _dry_run_eviction(block_entries: list, resume_point_entries: list, root: _Block, refcount: Callable[[int], int],
                      pins: Callable[[ResumePoint], int], wanted: int) -> int:
    """The pages, up to `wanted`, `PrefixCache.evict_pages` frees from heaps of these entries,
    counted over copies of them: the same order (least recently used first, a resume point
    before a block of equal age, pinned items set aside, a parent becoming a leaf joining the
    heap), nothing evicted. `refcount(page)`, `pins(resume point)`: as eviction would see them."""
    blocks, resume_points = list(block_entries), list(resume_point_entries)
    serial = itertools.count(2**62)  # entries pushed here follow every earlier one of equal last_used
    gone: set[int] = set()  # ids of the blocks and resume points the dry run evicts
    lost_children: dict[int, int] = {}  # block id -> its children or resume points the dry run evicts

    def leaf(block: _Block) -> bool:
        return block.children + len(block.resume_points) - lost_children.get(id(block), 0) == 0

    def current(entries: list, test: Callable[[Any], bool]) -> Any:
        while entries:
            stamp, _, item = entries[0]
            if stamp == item.last_used and not item.evicted and id(item) not in gone and test(item):
                return item
            heapq.heappop(entries)
        return None

    def drop(holder: _Block) -> None:
        lost_children[id(holder)] = lost_children.get(id(holder), 0) + 1
        if holder is not root and leaf(holder):
            heapq.heappush(blocks, (holder.last_used, next(serial), holder))

    freed = 0
    while freed < wanted:
        block = current(blocks, leaf)
        if block is not None and refcount(block.page) > 1:
            heapq.heappop(blocks)  # pinned: evict_pages sets it aside for this call
            continue
        resume_point = current(resume_points, lambda c: True)
        if resume_point is not None and pins(resume_point):
            heapq.heappop(resume_points)
            continue
        if block is None and resume_point is None:
            break
        if resume_point is not None and (block is None or resume_point.last_used <= block.last_used):
            heapq.heappop(resume_points)
            gone.add(id(resume_point))
            freed += resume_point.tail_page is not None
            drop(resume_point.holder)
        else:
            assert block is not None and block.parent is not None
            heapq.heappop(blocks)
            gone.add(id(block))
            freed += 1
            drop(block.parent)
    return freed
