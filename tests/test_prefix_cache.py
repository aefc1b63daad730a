"""Prefix cache: chained hashing, reuse rules, resume points, LRU leaf eviction and pins."""

import hashlib
import struct
from pathlib import Path

import jinja2
import pytest

from flare_core.kv import PageAllocator, PrefixCache, block_hash, extend_block_hashes

P = 64
IDENTITY = hashlib.sha256(b"test-model/recipe-1").digest()
FIXTURES = Path(__file__).parent / "fixtures"


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 151000 for i in range(n)]


def store(cache: PrefixCache, pages: PageAllocator, toks: list[int]) -> tuple[int, ...]:
    """Register the complete pages of `toks` as a finished request would, then drop the
    request's own references so only the cache holds them."""
    hashes: list[bytes] = []
    cache.extend_hashes(hashes, toks)
    table = pages.allocate(len(toks) // P)
    cache.insert(hashes, table, len(table))
    pages.release_all(table)
    return table


def save_resume_point(cache: PrefixCache, pages: PageAllocator, toks: list[int], end: int, prompt_end: bool):
    """Record a resume point at `end` the way the scheduler does around one prefill step."""
    hashes: list[bytes] = []
    table = pages.allocate(-(-end // P))
    slots = cache.reserve_resume_point(end, prompt_end)
    assert slots is not None
    cache.record_resume_point(hashes, table, toks, end, slots)
    pages.release_all(table)
    return slots


def test_block_hash_is_chained_blake2b_128_over_le_uint32():
    toks = tokens(130)
    hashes: list[bytes] = []
    extend_block_hashes(IDENTITY, hashes, toks, P)
    assert len(hashes) == 2
    first = hashlib.blake2b(IDENTITY + struct.pack("<64I", *toks[:64]), digest_size=16).digest()
    second = hashlib.blake2b(first + struct.pack("<64I", *toks[64:128]), digest_size=16).digest()
    assert hashes == [first, second]
    assert block_hash(first, toks[64:128]) == second


def test_same_tokens_different_identity_give_different_hashes():
    toks = tokens(256)
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(IDENTITY, a, toks, P)
    extend_block_hashes(hashlib.sha256(b"other-recipe").digest(), b, toks, P)
    assert all(x != y for x, y in zip(a, b)) and len(a) == 4


def test_changed_token_changes_hashes_from_its_block_on():
    toks = tokens(320)
    changed = list(toks)
    changed[2 * P + 5] += 1   # block 2
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(IDENTITY, a, toks, P)
    extend_block_hashes(IDENTITY, b, changed, P)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))


def test_bad_identity_and_token_ids_are_rejected():
    with pytest.raises(ValueError, match="identity must be 32 bytes, got 16"):
        PrefixCache(IDENTITY[:16], PageAllocator(4))
    with pytest.raises(ValueError, match="0..2\\*\\*32-1"):
        block_hash(IDENTITY, [-1] * P)
    with pytest.raises(ValueError, match="snapshot_rows must be >= 1"):
        PrefixCache(IDENTITY, PageAllocator(4), continuation_state=True)


def test_paged_scheme_reuses_complete_pages_up_to_last_prompt_token():
    pages = PageAllocator(16)
    cache = PrefixCache(IDENTITY, pages)
    toks = tokens(3 * P + 10)
    table = store(cache, pages, toks)

    exact_pages = cache.lookup(toks[:3 * P], [])
    assert exact_pages.num_tokens == 2 * P and exact_pages.pages == table[:2]   # last token recomputed
    longer = cache.lookup(toks + [5], [])
    assert longer.num_tokens == 3 * P and longer.pages == table and not longer.exact
    assert all(pages.refcount(p) == 3 for p in table[:2])   # cache + two hits
    diverged = list(toks)
    diverged[P + 3] = 0
    partial = cache.lookup(diverged, [])
    assert partial.num_tokens == P and partial.pages == table[:1]
    for hit in (exact_pages, longer, partial):
        cache.release_hit(hit)
    assert all(pages.refcount(p) == 1 for p in table)
    assert cache.lookup(tokens(200, seed=9), []).num_tokens == 0
    stats = cache.stats
    assert (stats.lookups, stats.hits, stats.reused_tokens) == (4, 3, 2 * P + 3 * P + P)


def render(messages: list[dict], generation_prompt: bool) -> str:
    template = (FIXTURES / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    return jinja2.Environment().from_string(template).render(
        messages=messages, add_generation_prompt=generation_prompt)


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(FIXTURES / "tokenizers" / "qwen3"))


def prompt_with_marks(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered prompt and the token endpoints after each message."""
    ids = tokenizer.encode(render(messages, True), add_special_tokens=False)
    marks = []
    for count in range(1, len(messages) + 1):
        prefix = tokenizer.encode(render(messages[:count], False), add_special_tokens=False)
        assert ids[:len(prefix)] == prefix
        marks.append(len(prefix))
    return ids, marks


def conversation() -> list[dict]:
    system = ("You are a meticulous assistant for a storage team. Answer with short, precise "
              "sentences, cite the configuration keys you rely on, and say so when unsure. ") * 5
    return [{"role": "system", "content": system},
            {"role": "user", "content": "Our nightly compaction job doubles disk usage for an hour. Why?"}]


def test_multi_turn_reuse_through_message_mark_resume_points(qwen_tokenizer):
    pages = PageAllocator(64)
    cache = PrefixCache(IDENTITY, pages, continuation_state=True, snapshot_rows=8, logits_rows=2)
    turn1 = conversation()
    prompt1, marks1 = prompt_with_marks(qwen_tokenizer, turn1)
    assert len(prompt1) > 2 * P and marks1[-1] < len(prompt1)
    saved = {end: save_resume_point(cache, pages, prompt1, end, end == len(prompt1))
             for end in [*marks1, len(prompt1)]}
    assert saved[len(prompt1)].logits_row is not None and saved[marks1[0]].logits_row is None

    turn2 = turn1 + [{"role": "assistant", "content": "Compaction writes new segments before deleting old ones."},
                     {"role": "user", "content": "Can we cap it?"}]
    prompt2, marks2 = prompt_with_marks(qwen_tokenizer, turn2)
    assert prompt2[:len(prompt1)] == prompt1 and marks2[:2] == marks1
    hit = cache.lookup(prompt2, [])
    assert hit.num_tokens == len(prompt1) and not hit.exact
    assert hit.resume_point.snapshot_row == saved[len(prompt1)].snapshot_row
    assert hit.resume_point.tail_page == saved[len(prompt1)].tail_page
    assert len(hit.pages) == len(prompt1) // P
    cache.release_hit(hit)

    # An edited first question still shares the system message: reuse stops at its mark.
    edited = [turn1[0], {"role": "user", "content": "Why does compaction need so much space?"}]
    prompt3, _ = prompt_with_marks(qwen_tokenizer, edited)
    hit = cache.lookup(prompt3, [])
    assert hit.num_tokens == marks1[0]
    assert hit.resume_point.snapshot_row == saved[marks1[0]].snapshot_row
    cache.release_hit(hit)

    # The same turn-1 prompt again is an exact hit: stored logits give the first token.
    hit = cache.lookup(prompt1, [])
    assert hit.exact and hit.num_tokens == len(prompt1) and hit.resume_point.logits_row is not None
    cache.release_hit(hit)


def test_state_scheme_reuses_only_resume_point_positions():
    pages = PageAllocator(16)
    cache = PrefixCache(IDENTITY, pages, continuation_state=True, snapshot_rows=2)
    toks = tokens(4 * P)
    store(cache, pages, toks)
    assert cache.lookup(toks, []).num_tokens == 0    # pages alone carry no state
    save_resume_point(cache, pages, toks, 100, prompt_end=False)
    hit = cache.lookup(toks, [])
    assert hit.num_tokens == 100 and len(hit.pages) == 1 and hit.resume_point.tail_page is not None
    cache.release_hit(hit)


def test_paged_exact_hit_and_tail_extension():
    pages = PageAllocator(16)
    cache = PrefixCache(IDENTITY, pages, logits_rows=1)
    prompt = tokens(P + 20)
    slots = save_resume_point(cache, pages, prompt, len(prompt), prompt_end=True)
    assert slots.tail_page is not None and slots.logits_row == 0 and slots.snapshot_row is None
    exact = cache.lookup(prompt, [])
    assert exact.exact and exact.num_tokens == P + 20 and len(exact.pages) == 1
    extended = cache.lookup(prompt + [1, 2, 3], [])
    assert not extended.exact and extended.num_tokens == P + 20   # the tail page carries 20 more
    shorter = cache.lookup(prompt[:P + 10], [])
    assert shorter.resume_point is None and shorter.num_tokens == P
    for hit in (exact, extended, shorter):
        cache.release_hit(hit)


def test_lru_evicts_unpinned_leaves_oldest_first_and_parents_become_leaves():
    pages = PageAllocator(8)
    cache = PrefixCache(IDENTITY, pages)
    chain_a = tokens(3 * P, seed=1)
    chain_b = chain_a[:P] + tokens(P, seed=2)           # shares block 0 with chain a
    a1, a2, a3 = store(cache, pages, chain_a)
    b1, b2 = store(cache, pages, chain_b)
    assert b1 != a1 and pages.refcount(b1) == 0         # block 0 was already cached
    cache.release_hit(cache.lookup(chain_a + [9], []))  # a is now the most recently used
    evicted = []
    for wanted in range(pages.free_count + 1, 9):
        before = {p for p in (a1, a2, a3, b2) if pages.refcount(p)}
        cache.evict_pages(wanted)
        evicted += sorted(before - {p for p in before if pages.refcount(p)})
    assert evicted == [b2, a3, a2, a1]
    assert cache.stats.evictions == 4 and cache.stats.cached_blocks == 0 and pages.free_count == 8


def test_pinned_pages_are_never_evicted():
    pages = PageAllocator(8)
    cache = PrefixCache(IDENTITY, pages)
    toks = tokens(3 * P)
    table = store(cache, pages, toks)
    store(cache, pages, tokens(2 * P, seed=3))
    hit = cache.lookup(toks[:2 * P + 1], [])             # a live request pins blocks 0 and 1
    cache.evict_pages(8)
    assert all(pages.refcount(p) == 2 for p in hit.pages)
    assert pages.refcount(table[2]) == 0                 # the unpinned leaf below went
    assert cache.stats.cached_blocks == 2
    cache.release_hit(hit)
    cache.evict_pages(8)
    assert pages.free_count == 8 and cache.stats.cached_blocks == 0


def test_snapshot_pressure_evicts_least_recent_unpinned_resume_point():
    pages = PageAllocator(16)
    cache = PrefixCache(IDENTITY, pages, continuation_state=True, snapshot_rows=2)
    first, second, third = tokens(100, seed=1), tokens(100, seed=2), tokens(100, seed=3)
    save_resume_point(cache, pages, first, 70, prompt_end=False)
    save_resume_point(cache, pages, second, 70, prompt_end=False)
    pinned = cache.lookup(first, [])                     # first is now recent and pinned
    save_resume_point(cache, pages, third, 70, prompt_end=False)
    assert cache.lookup(second, []).num_tokens == 0      # second was the LRU resume point
    hit = cache.lookup(third, [])
    assert hit.num_tokens == 70
    cache.release_hit(hit)
    # Both slots taken, `first` pinned: a new reservation must evict `third`, never `first`.
    slots = cache.reserve_resume_point(70, prompt_end=False)
    assert slots is not None and slots.snapshot_row == hit.resume_point.snapshot_row
    assert cache.lookup(third, []).num_tokens == 0
    assert pinned.resume_point.pins == 1 and not pinned.resume_point.evicted
    cache.discard(slots)
    cache.release_hit(pinned)
    assert pinned.resume_point.pins == 0


def test_everything_returns_after_full_eviction():
    pages = PageAllocator(32)
    cache = PrefixCache(IDENTITY, pages, continuation_state=True, snapshot_rows=4, logits_rows=2)
    for seed in range(4):
        toks = tokens(150 + seed, seed)
        save_resume_point(cache, pages, toks, 90, prompt_end=False)
        save_resume_point(cache, pages, toks, len(toks), prompt_end=True)
    assert pages.free_count < 32
    cache.evict_pages(32)
    assert pages.free_count == 32
    assert cache.free_snapshot_rows == 4 and cache.free_logits_rows == 2
    assert cache.stats.resume_points == 0 and cache.stats.cached_blocks == 0


def populated_cache(seed: int) -> tuple[PrefixCache, PageAllocator, list]:
    """A cache of branching prefixes, resume points with tail pages and logits, some pages held
    by live requests, some resume points pinned by restores in flight, and hits held: built the
    same way for every `seed`, so two copies can be compared."""
    import random

    rng = random.Random(seed)
    pages = PageAllocator(2000)
    cache = PrefixCache(IDENTITY, pages, P, logits_rows=12)
    trunks = [tokens(rng.randrange(64, 640), seed=s) for s in range(6)]
    hits = []
    for i in range(30):
        trunk = rng.choice(trunks)
        toks = trunk[:rng.randrange(64, len(trunk) + 1)] + tokens(rng.randrange(0, 200), seed=100 + i)
        if rng.random() < 0.5:
            store(cache, pages, toks)
        else:  # unaligned: a resume point always keeps its partial last page
            end = rng.randrange(1, len(toks) + 1)
            save_resume_point(cache, pages, toks, end - (end % P == 0), prompt_end=True)
        if rng.random() < 0.3:  # a request still holds what it looked up (pages pinned; a resume point, too)
            hits.append(cache.lookup(toks, []))
    return cache, pages, hits


@pytest.mark.parametrize("seed", range(6))
def test_the_dry_run_of_eviction_frees_what_eviction_frees_and_changes_nothing(seed):
    """`evictable_pages(n)` counts, without evicting, what `evict_pages` then frees; counting what
    dropping held hits would add (`released`, `unpinned`) matches dropping them and evicting."""
    from collections import Counter

    for wanted in (1, 5, 40, 2000):
        cache, pages, hits = populated_cache(seed)
        free, stats = pages.free_count, cache.stats
        counted = cache.evictable_pages(wanted)
        assert (pages.free_count, cache.stats) == (free, stats)  # nothing changed
        cache.evict_pages(free + wanted)
        assert pages.free_count - free == counted

        cache, pages, hits = populated_cache(seed)
        released = Counter(page for hit in hits for page in hit.pages)
        unpinned = Counter(hit.resume_point for hit in hits if hit.resume_point is not None)
        counted = cache.evictable_pages(wanted, released, unpinned)
        for hit in hits:
            cache.release_hit(hit)
        cache.evict_pages(free + wanted)
        assert pages.free_count - free == counted
        assert counted >= cache.evictable_pages(0)
