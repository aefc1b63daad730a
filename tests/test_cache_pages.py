"""Page and state-row allocator invariants."""

import random

import pytest

from flare_core.kv import (PageAllocator, PagesExhausted, RowsExhausted, StateRowAllocator, pages_for_tokens,
                           request_page_need)


def test_allocate_release_restores_free_count():
    pages = PageAllocator(8)
    taken = pages.allocate(5)
    assert len(set(taken)) == 5 and pages.free_count == 3 and pages.used_count == 5
    assert all(pages.refcount(p) == 1 for p in taken)
    pages.release_all(taken)
    assert pages.free_count == 8 and all(pages.refcount(p) == 0 for p in range(8))


def test_shared_page_frees_on_last_release():
    pages = PageAllocator(4)
    (page,) = pages.allocate(1)
    pages.retain(page)
    pages.retain(page)
    assert pages.refcount(page) == 3
    pages.release(page)
    pages.release(page)
    assert pages.free_count == 3
    pages.release(page)
    assert pages.free_count == 4


def test_double_release_and_bad_ids_raise():
    pages = PageAllocator(2)
    (page,) = pages.allocate(1)
    pages.release(page)
    with pytest.raises(ValueError, match="already free"):
        pages.release(page)
    with pytest.raises(ValueError, match="free"):
        pages.retain(page)
    with pytest.raises(ValueError, match="outside 0..1"):
        pages.refcount(2)
    assert pages.free_count == 2


def test_exhaustion_names_counts_and_changes_nothing():
    pages = PageAllocator(3)
    pages.allocate(2)
    with pytest.raises(PagesExhausted, match="requested 2 pages but only 1 of 3"):
        pages.allocate(2)
    assert pages.free_count == 1


def test_free_order_is_deterministic_oldest_freed_first():
    pages = PageAllocator(3)
    a, b, c = pages.allocate(3)
    pages.release(b)
    pages.release(a)
    assert pages.allocate(2) == (b, a)


def test_random_refcount_scenario_restores_free_count():
    rng = random.Random(5)
    pages = PageAllocator(32)
    held: list[int] = []
    for _ in range(2000):
        action = rng.random()
        if action < 0.4 and pages.free_count:
            held.extend(pages.allocate(rng.randint(1, min(3, pages.free_count))))
        elif action < 0.6 and held:
            page = rng.choice(held)
            pages.retain(page)
            held.append(page)
        elif held:
            pages.release(held.pop(rng.randrange(len(held))))
        assert pages.free_count + len(set(held)) == 32
        assert all(pages.refcount(p) == held.count(p) for p in set(held))
    pages.release_all(held)
    assert pages.free_count == 32


def test_state_rows_lowest_first_and_generation_increments_on_reuse():
    rows = StateRowAllocator(3, row_bytes=1024)
    assert rows.total_bytes == 3072
    assert [rows.allocate() for _ in range(3)] == [(0, 1), (1, 1), (2, 1)]
    with pytest.raises(RowsExhausted, match="all 3 state rows"):
        rows.allocate()
    rows.free(1)
    rows.free(0)
    assert rows.allocate() == (0, 2)
    assert rows.allocate() == (1, 2)
    rows.free(2)
    with pytest.raises(ValueError, match="already free"):
        rows.free(2)


def test_stateless_scheme_still_tracks_rows_as_slots():
    slots = StateRowAllocator(2)
    assert slots.row_bytes == 0 and slots.total_bytes == 0
    row, generation = slots.allocate()
    assert (row, generation) == (0, 1) and slots.free_count == 1
    slots.free(row)
    assert slots.free_count == 2 and slots.generation(row) == 1


def test_page_need_helpers():
    assert pages_for_tokens(0, 64) == 0
    assert pages_for_tokens(64, 64) == 1
    assert pages_for_tokens(65, 64) == 2
    # 100 prompt + 29 generated: the last generated token is never written -> 128 positions.
    assert request_page_need(100, 29, 64) == 2
    assert request_page_need(100, 30, 64) == 3
    with pytest.raises(ValueError, match="max_tokens"):
        request_page_need(10, 0, 64)
