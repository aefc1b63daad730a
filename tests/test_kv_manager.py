"""The KV-cache manager, the scheduler's one door to pages, state rows and the prefix cache:
counting the pages a step could have changes nothing, and taking them takes exactly that many
(free pages, then evicted cache pages, then pages freed by dropping waiting requests' hits)."""

from __future__ import annotations

import hashlib

import pytest

from flare_core.kv import KvCacheManager, PageAllocator, PagesExhausted, PrefixCache

P = 64
IDENTITY = hashlib.sha256(b"kv-manager-test").digest()


class Known:
    """A request's known tokens, as the scheduler's Request gives them."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    @property
    def num_known_tokens(self) -> int:
        return len(self.tokens)

    def tokens_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def prompt(pages: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 151000 for i in range(pages * P)]


def served(kv: KvCacheManager, request_id: str, tokens: list[int]) -> None:
    """A request admitted for all of `tokens`, computed, and released (its pages stay cached)."""
    kv.open(request_id)
    kv.lookup(request_id, tokens)
    assert kv.admit(request_id, len(tokens), headroom=0) is not None
    kv.release(request_id, Known(tokens), len(tokens))
    kv.close(request_id)


def test_counting_pages_changes_nothing_and_extend_takes_exactly_the_count():
    pages = PageAllocator(40)
    prefix = PrefixCache(IDENTITY, pages, P, logits_rows=4)
    kv = KvCacheManager(pages, 4, P, prefix)
    for seed in range(3):  # 15 pages cached, 25 free
        served(kv, f"done{seed}", prompt(5, seed))
    kv.open("waiting")  # holds a hit on done0's pages while it waits
    assert kv.lookup("waiting", prompt(5, 0) + [7]).num_tokens == 5 * P
    kv.open("live")
    kv.lookup("live", prompt(1, 9))
    assert kv.admit("live", P, headroom=0) is not None  # 24 free now
    held = (kv.free_pages, prefix.stats, kv.request_page_refs, kv.cached_pages)
    # Free 24; the cache evicts done1's and done2's 10; dropping the waiting hit frees done0's 5.
    assert [kv.obtainable(n) for n in (10, 24, 30, 34, 36, 39, 60)] == [10, 24, 30, 34, 36, 39, 39]
    assert kv.obtainable(36, drop_hits=False) == 34
    assert (kv.free_pages, prefix.stats, kv.request_page_refs, kv.cached_pages) == held
    kv.extend({"live": 39})
    assert kv.free_pages == 0 and kv.cached_pages == 0
    with pytest.raises(PagesExhausted):
        kv.extend({"live": 1})
    # The waiting request's hit was given back: it looks up again and finds nothing.
    kv.close("waiting")
    kv.open("waiting")
    assert kv.lookup("waiting", prompt(5, 0) + [7]).num_tokens == 0


def test_admission_that_cannot_be_had_evicts_nothing():
    pages = PageAllocator(12)
    prefix = PrefixCache(IDENTITY, pages, P, logits_rows=4)
    kv = KvCacheManager(pages, 2, P, prefix)
    served(kv, "done", prompt(6, 1))  # 6 cached, 6 free
    kv.open("big")
    kv.lookup("big", prompt(13, 2))
    stats = prefix.stats
    assert kv.admit("big", 13 * P, headroom=0) is None
    assert prefix.stats == stats and kv.cached_pages == 6 and kv.free_state_rows == 2
    assert kv.admit("big", 12 * P, headroom=0) is not None  # evicting all six now
    assert kv.cached_pages == 0 and kv.free_pages == 0
