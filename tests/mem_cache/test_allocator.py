"""PageAllocator and slot/page arithmetic: plain integers, no torch, no model."""

from __future__ import annotations

import random

import pytest

from servelm.mem_cache.allocator import PageAllocator, pages_of, slots_for


@pytest.mark.parametrize("num_pages,page_size", [(0, 1), (-3, 1), (4, 0), (4, -1), (2.5, 1), (4, 1.0), (True, 1)])
def test_bad_sizes_raise_value_error(num_pages, page_size):
    with pytest.raises(ValueError, match="num_pages|page_size"):
        PageAllocator(num_pages, page_size)


def test_fresh_allocator_is_all_free():
    a = PageAllocator(8, page_size=4)
    assert (a.num_pages, a.page_size, a.num_free_pages, a.num_used_pages, a.num_tokens) == (8, 4, 8, 0, 32)
    assert all(a.is_free(p) for p in range(8))


def test_alloc_hands_out_lowest_ids_first():
    a = PageAllocator(10)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) == [3, 4]
    a.free([1, 4])
    assert a.alloc(1) == [1]
    assert a.alloc(3) == [4, 5, 6]
    assert a.num_free_pages == 3


def test_alloc_zero_and_negative():
    a = PageAllocator(2)
    assert a.alloc(0) == []
    assert a.num_free_pages == 2
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_alloc_too_many_returns_none_and_takes_nothing():
    a = PageAllocator(4)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) is None
    assert a.num_free_pages == 1
    assert a.alloc(1) == [3]
    assert a.alloc(1) is None
    assert a.num_free_pages == 0


def test_free_rejects_double_free_out_of_range_and_duplicates_atomically():
    a = PageAllocator(4)
    pages = a.alloc(3)
    a.free([pages[0]])
    with pytest.raises(ValueError, match="double free of page 0"):
        a.free([0])
    with pytest.raises(ValueError, match="out of range"):
        a.free([4])
    with pytest.raises(ValueError, match="out of range"):
        a.free([-1])
    with pytest.raises(ValueError, match="double free of page 1"):
        a.free([1, 1])
    # A rejected call frees nothing, even the valid pages listed before the bad one.
    with pytest.raises(ValueError):
        a.free([1, 2, 0])
    assert a.num_free_pages == 2 and not a.is_free(1) and not a.is_free(2)
    a.free(iter([2, 1]))  # any iterable
    assert a.num_free_pages == 4


def test_is_free_range_check():
    a = PageAllocator(2)
    with pytest.raises(ValueError):
        a.is_free(2)


def test_reset_frees_everything():
    a = PageAllocator(5)
    a.alloc(4)
    a.reset()
    assert a.num_free_pages == 5
    assert a.alloc(5) == [0, 1, 2, 3, 4]


def test_randomized_alloc_free_matches_a_model():
    rng = random.Random(0)
    a = PageAllocator(64)
    owned: set[int] = set()
    for _ in range(2000):
        if rng.random() < 0.5:
            n = rng.randint(0, 10)
            got = a.alloc(n)
            if n > 64 - len(owned):
                assert got is None
                continue
            free_sorted = sorted(set(range(64)) - owned)
            assert got == free_sorted[:n]  # lowest ids first
            owned.update(got)
        elif owned:
            back = rng.sample(sorted(owned), rng.randint(1, len(owned)))
            a.free(back)
            owned.difference_update(back)
        assert a.num_free_pages == 64 - len(owned)
        assert a.num_used_pages == len(owned)


@pytest.mark.parametrize("P", [1, 4, 16])
def test_slots_for_follows_the_page_table(P):
    pages = [7, 2, 5]
    slots = slots_for(pages, P, 0, 3 * P)
    assert slots == [pages[p // P] * P + p % P for p in range(3 * P)]
    assert len(set(slots)) == 3 * P
    # A sub-range is the matching slice of the whole.
    assert slots_for(pages, P, 1, 2 * P + 1) == slots[1:2 * P + 1]
    assert slots_for(pages, P, 2, 2) == []


def test_slots_for_page_size_4_by_hand():
    assert slots_for([3, 0], 4, 2, 7) == [14, 15, 0, 1, 2]


def test_slots_for_rejects_bad_ranges():
    with pytest.raises(ValueError, match="pages"):
        slots_for([0, 1], 4, 0, 9)
    with pytest.raises(ValueError):
        slots_for([0, 1], 4, 3, 2)
    with pytest.raises(ValueError):
        slots_for([0, 1], 4, -1, 2)


@pytest.mark.parametrize("P", [1, 4, 16])
def test_pages_of_inverts_slots_for(P):
    pages = [9, 0, 4, 1]
    assert pages_of(slots_for(pages, P, 0, 4 * P), P) == pages
    # The last page may be partial.
    assert pages_of(slots_for(pages, P, 0, 3 * P + 1), P) == pages
    assert pages_of([], P) == []


def test_pages_of_rejects_misaligned_slots():
    with pytest.raises(ValueError, match="not page aligned"):
        pages_of([5, 6, 7, 8], 4)
