"""Prefix-cache policies (RadixCache, NoPrefixCache) over the page allocator: no torch, no model."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from servelm.mem_cache.allocator import PageAllocator, pages_of, slots_for
from servelm.mem_cache.radix_cache import (
    BasePrefixCache,
    NoPrefixCache,
    RadixCache,
    TreeNode,
    check_integrity,
)


@dataclass
class Req:
    """A running request as the scheduler holds it."""

    tokens: list[int]
    slots: list[int]
    cache_protected_len: int
    node: TreeNode

    def own_pages(self, P: int) -> list[int]:
        return pages_of(self.slots[self.cache_protected_len:], P)


def make(num_pages: int, P: int) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, P)
    return alloc, RadixCache(alloc)


def start(cache: BasePrefixCache, tokens: list[int]) -> Req:
    """Match, lock, and allocate pages for the uncached rest of `tokens` (KV 'computed' by the caller)."""
    P = cache.page_size
    m = cache.match_prefix(tokens)
    cache.inc_lock_ref(m.node)
    n_new = len(tokens) - len(m.slots)
    pages = cache.allocator.alloc(-(-n_new // P))
    assert pages is not None, "test pool too small"
    return Req(list(tokens), m.slots + slots_for(pages, P, 0, n_new), len(m.slots), m.node)


def finish(cache: BasePrefixCache, r: Req) -> None:
    cache.cache_finished_req(r.tokens, r.slots, r.cache_protected_len, r.node)


def cache_seq(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Put `tokens` into the cache the way a finished request would; returns its slots."""
    r = start(cache, tokens)
    finish(cache, r)
    return r.slots


def extend(cache: BasePrefixCache, r: Req, new_tokens: list[int]) -> bool:
    """Append tokens to a running request (decode or next prefill chunk), filling its partial last page
    first; False (nothing changed) if the pool has no room even after evicting."""
    P, alloc = cache.page_size, cache.allocator
    n = len(new_tokens)
    room = min(n, (P - len(r.slots) % P) % P)  # free slots left in the request's partial last page
    need = -(-(n - room) // P)
    if need > alloc.num_free_pages:
        cache.evict(need - alloc.num_free_pages)
    pages = alloc.alloc(need)
    if pages is None:
        return False
    r.slots += [r.slots[-1] + 1 + i for i in range(room)] + slots_for(pages, P, 0, n - room)
    r.tokens += new_tokens
    return True


def in_use(reqs: list[Req], P: int) -> int:
    return sum(len(r.own_pages(P)) for r in reqs)


# ---- matching ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 4, 16])
def test_empty_cache_matches_nothing(P):
    alloc, cache = make(8, P)
    m = cache.match_prefix(list(range(40)))
    assert m.slots == [] and m.node is cache.root
    assert cache.hit_stats() == (0, 40)
    check_integrity(alloc, cache, 0)


@pytest.mark.parametrize("P", [1, 4, 16])
def test_insert_then_match_returns_the_same_slots(P):
    alloc, cache = make(16, P)
    tokens = list(range(3 * P))
    pages = alloc.alloc(3)
    slots = slots_for(pages, P, 0, 3 * P)
    assert cache.insert(tokens, slots) == 0
    assert cache.cached_pages == 3 and cache.evictable_pages == 3 and cache.protected_pages == 0
    check_integrity(alloc, cache, 0)
    m = cache.match_prefix(tokens + [99] * (P + 1))
    assert m.slots == slots
    assert m.node is not cache.root and m.node.value == slots
    assert cache.hit_stats() == (3 * P, 4 * P + 1)
    assert cache.hit_rate == pytest.approx(3 * P / (4 * P + 1))


def test_match_truncates_to_whole_pages():
    alloc, cache = make(16, 4)
    slots = cache_seq(cache, list(range(8)))
    assert cache.match_prefix(list(range(7))).slots == slots[:4]
    assert cache.match_prefix(list(range(3))).slots == []
    # Diverging inside the second page keeps only the first page.
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7]).slots == slots[:4]
    # Diverging inside the first page matches nothing.
    assert cache.match_prefix([0, 99, 2, 3, 4, 5, 6, 7]).slots == []
    check_integrity(alloc, cache, 0)


@pytest.mark.parametrize("P", [1, 4])
def test_partial_match_splits_at_a_page_boundary(P):
    alloc, cache = make(16, P)
    tokens = list(range(3 * P))
    slots = cache_seq(cache, tokens)
    (node,) = cache.root.children.values()
    assert len(node.key) == 3 * P
    m = cache.match_prefix(tokens[:P + P // 2] + [99] * P)  # ends inside the 2nd page
    assert m.slots == slots[:P]
    upper = m.node
    assert upper.key == tuple(tokens[:P]) and upper.parent is cache.root
    (lower,) = upper.children.values()
    assert lower.key == tuple(tokens[P:]) and lower.value == slots[P:]
    # The split is invisible to lookups.
    assert cache.match_prefix(tokens).slots == slots
    assert cache.cached_pages == 3
    check_integrity(alloc, cache, 0)


# ---- insertion --------------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 4])
def test_insert_overlapping_and_extending_sequences(P):
    alloc, cache = make(32, P)
    a = list(range(100, 100 + 2 * P))
    slots_a = slots_for(alloc.alloc(2), P, 0, 2 * P)
    assert cache.insert(a, slots_a) == 0

    # Extends a: the first 2P tokens are already cached; the caller's duplicate pages stay its own to free.
    ext = a + [7] * P
    dup = alloc.alloc(3)
    slots_ext = slots_for(dup, P, 0, 3 * P)
    assert cache.insert(ext, slots_ext) == 2 * P
    alloc.free(dup[:2])
    assert cache.match_prefix(ext).slots == slots_a + slots_ext[2 * P:]

    # Branches off a after its first page.
    br = a[:P] + [8] * P
    pages = alloc.alloc(2)
    slots_br = slots_for(pages, P, 0, 2 * P)
    assert cache.insert(br, slots_br) == P
    alloc.free(pages[:1])
    assert cache.match_prefix(br).slots == slots_a[:P] + slots_br[P:]
    assert cache.match_prefix(ext).slots == slots_a + slots_ext[2 * P:]

    # A prefix of what is cached adds nothing.
    pages = alloc.alloc(1)
    assert cache.insert(a[:P], slots_for(pages, P, 0, P)) == P
    alloc.free(pages)
    assert cache.insert([], []) == 0
    assert cache.cached_pages == 4
    check_integrity(alloc, cache, 0)


def test_insert_rejects_bad_arguments():
    alloc, cache = make(8, 4)
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2, 3, 4], [0, 1, 2])
    with pytest.raises(ValueError, match="multiple of page_size"):
        cache.insert([1, 2, 3], [0, 1, 2])
    with pytest.raises(ValueError, match="whole page"):
        cache.insert([1, 2, 3, 4], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="whole page"):
        cache.insert([1, 2, 3, 4], [0, 1, 2, 7])
    assert cache.cached_pages == 0


# ---- locking and eviction ---------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 4])
def test_lock_protects_the_whole_path(P):
    alloc, cache = make(32, P)
    base = list(range(2 * P))
    cache_seq(cache, base + [50] * P)
    cache_seq(cache, base + [60] * P)  # splits: base (2 pages) -> two 1-page leaves
    assert cache.cached_pages == 4
    m = cache.match_prefix(base + [50] * P)
    cache.inc_lock_ref(m.node)
    assert (cache.protected_pages, cache.evictable_pages) == (3, 1)
    check_integrity(alloc, cache, 0)
    assert cache.evict(100) == 1  # only the unlocked sibling leaf can go
    assert cache.match_prefix(base + [50] * P).slots == m.slots
    assert cache.match_prefix(base + [60] * P).slots == m.slots[:2 * P]
    cache.inc_lock_ref(m.node)  # two requests on the same path
    cache.dec_lock_ref(m.node)
    assert cache.protected_pages == 3
    cache.dec_lock_ref(m.node)
    assert (cache.protected_pages, cache.evictable_pages) == (0, 3)
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(m.node)
    assert cache.evict(100) == 3
    assert alloc.num_free_pages == 32
    check_integrity(alloc, cache, 0)


def test_locking_the_root_is_a_no_op():
    alloc, cache = make(8, 1)
    cache.inc_lock_ref(cache.root)
    cache.dec_lock_ref(cache.root)
    assert cache.protected_pages == 0 and cache.reset()


def test_lock_on_a_node_that_is_split_later_still_unlocks_cleanly():
    alloc, cache = make(16, 2)
    cache_seq(cache, list(range(8)))
    m = cache.match_prefix(list(range(8)))
    cache.inc_lock_ref(m.node)
    cache.match_prefix([0, 1, 2, 3, 9, 9])  # splits the locked node
    check_integrity(alloc, cache, 0)
    assert cache.protected_pages == 4
    cache.dec_lock_ref(m.node)
    assert cache.protected_pages == 0 and cache.evictable_pages == 4
    check_integrity(alloc, cache, 0)


def test_evict_in_lru_order():
    alloc, cache = make(16, 2)
    a, b, c = [1, 1], [2, 2], [3, 3]
    for seq in (a, b, c):
        cache_seq(cache, seq)
    cache.match_prefix(a)  # a is now the most recently used; b the least
    assert cache.evict(1) == 1
    assert cache.match_prefix(b).slots == []
    assert cache.match_prefix(a).slots and cache.match_prefix(c).slots
    cache.match_prefix(a)
    assert cache.evict(1) == 1
    assert cache.match_prefix(c).slots == [] and cache.match_prefix(a).slots
    check_integrity(alloc, cache, 0)


def test_insert_refreshes_lru_time():
    alloc, cache = make(16, 1)
    cache_seq(cache, [1])
    cache_seq(cache, [2])
    pages = alloc.alloc(1)
    assert cache.insert([1], slots_for(pages, 1, 0, 1)) == 1  # touches [1]
    alloc.free(pages)
    cache.evict(1)
    assert cache.match_prefix([1]).slots and not cache.match_prefix([2]).slots


def test_parent_is_evicted_after_its_children():
    alloc, cache = make(16, 4)
    cache_seq(cache, list(range(8)))
    cache_seq(cache, list(range(4)) + [9] * 4)  # parent [0..3] with two 1-page leaves
    assert len(cache.root.children) == 1 and len(next(iter(cache.root.children.values())).children) == 2
    assert cache.evict(2) == 2  # both leaves, the parent stays
    assert len(cache.match_prefix(list(range(8))).slots) == 4
    assert cache.evict(1) == 1  # now the parent, a leaf itself
    assert not cache.root.children and alloc.num_free_pages == 16
    check_integrity(alloc, cache, 0)

    cache_seq(cache, list(range(8)))
    cache_seq(cache, list(range(4)) + [9] * 4)
    assert cache.evict(3) == 3  # one call cascades up to the parent
    assert cache.cached_pages == 0 and alloc.num_free_pages == 16
    check_integrity(alloc, cache, 0)


def test_evict_trims_a_long_leaf_from_its_tail():
    alloc, cache = make(16, 4)
    slots = cache_seq(cache, list(range(12)))
    assert cache.evict(1) == 1
    assert cache.match_prefix(list(range(12))).slots == slots[:8]
    assert alloc.is_free(slots[8] // 4)
    assert cache.evict(0) == 0 and cache.evict(-2) == 0
    assert cache.evict(10) == 2
    check_integrity(alloc, cache, 0)


def test_evict_returns_what_it_could_free():
    alloc, cache = make(16, 1)
    r = start(cache, [1, 2, 3])
    finish(cache, r)
    locked = start(cache, [1, 2, 3, 4])
    cache_seq(cache, [5, 6])
    assert cache.evict(100) == 2
    assert cache.cached_pages == 3  # [1,2,3] is locked by the running request
    check_integrity(alloc, cache, in_use([locked], 1))


# ---- reset ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 4])
def test_reset_refuses_while_locked_and_flushes_after(P):
    alloc, cache = make(32, P)
    cache_seq(cache, list(range(3 * P)))
    r = start(cache, list(range(3 * P)) + [5])
    assert cache.reset() is False
    assert cache.cached_pages == 3
    check_integrity(alloc, cache, in_use([r], P))
    finish(cache, r)
    assert cache.reset() is True
    assert cache.cached_pages == 0 and alloc.num_free_pages == 32
    assert cache.match_prefix(list(range(3 * P))).slots == []
    check_integrity(alloc, cache, 0)
    assert cache.hit_stats()[1] > 0  # counters are monotonic across flushes


# ---- request lifecycle ------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 4])
@pytest.mark.parametrize("order", ["first_then_second", "second_then_first"])
def test_two_requests_sharing_a_prefix_finish_in_either_order(P, order):
    alloc, cache = make(64, P)
    system = list(range(1000, 1000 + 2 * P))
    cache_seq(cache, system)
    r1 = start(cache, system + [1] * (P + 1))
    r2 = start(cache, system + [2] * (2 * P + 3))
    assert r1.cache_protected_len == r2.cache_protected_len == 2 * P
    assert r1.slots[:2 * P] == r2.slots[:2 * P]
    check_integrity(alloc, cache, in_use([r1, r2], P))
    assert cache.protected_pages == 2
    reqs = [r1, r2] if order == "first_then_second" else [r2, r1]
    finish(cache, reqs[0])
    check_integrity(alloc, cache, in_use(reqs[1:], P))
    assert cache.protected_pages == 2  # the other request still holds the shared prefix
    finish(cache, reqs[1])
    check_integrity(alloc, cache, 0)
    assert cache.protected_pages == 0
    # Aligned parts are cached; the partial trailing pages were freed.
    a1, a2 = len(r1.tokens) // P * P, len(r2.tokens) // P * P
    assert cache.match_prefix(r1.tokens).slots == r1.slots[:a1]
    assert cache.match_prefix(r2.tokens).slots == r2.slots[:a2]
    assert cache.cached_pages == (a1 + a2) // P - 2
    assert alloc.num_free_pages == 64 - cache.cached_pages
    assert cache.reset() and alloc.num_free_pages == 64


@pytest.mark.parametrize("P", [1, 4])
def test_concurrent_identical_prompts_free_the_loser_duplicates(P):
    alloc, cache = make(32, P)
    tokens = list(range(3 * P))
    r1, r2 = start(cache, tokens), start(cache, tokens)  # both miss: each computes its own copy
    assert r1.cache_protected_len == r2.cache_protected_len == 0 and set(r1.slots).isdisjoint(r2.slots)
    finish(cache, r1)
    finish(cache, r2)
    check_integrity(alloc, cache, 0)
    assert cache.cached_pages == 3 and alloc.num_free_pages == 32 - 3
    assert cache.match_prefix(tokens).slots == r1.slots


def test_finished_request_with_only_a_partial_page():
    alloc, cache = make(8, 4)
    r = start(cache, [1, 2, 3])
    assert len(r.own_pages(4)) == 1
    finish(cache, r)
    assert cache.cached_pages == 0 and alloc.num_free_pages == 8
    check_integrity(alloc, cache, 0)


@pytest.mark.parametrize("P", [1, 4])
def test_cache_finished_req_frees_pages_reserved_past_the_computed_tokens(P):
    alloc, cache = make(16, P)
    tokens = list(range(P + 1))
    m = cache.match_prefix(tokens)
    cache.inc_lock_ref(m.node)
    pages = alloc.alloc(4)  # 2 pages hold the computed tokens, 2 more were reserved for a chunk that never ran
    slots = slots_for(pages, P, 0, 4 * P)
    cache.cache_finished_req(tokens, slots, 0, m.node)
    check_integrity(alloc, cache, 0)
    aligned = (P + 1) // P * P
    assert cache.cached_pages == aligned // P and alloc.num_free_pages == 16 - aligned // P
    assert cache.match_prefix(tokens).slots == slots[:aligned]


def test_cache_finished_req_validates_arguments():
    alloc, cache = make(8, 4)
    r = start(cache, list(range(5)))
    with pytest.raises(ValueError, match="slots"):
        cache.cache_finished_req(r.tokens, r.slots[:-1], 0, r.node)
    with pytest.raises(ValueError, match="cache_protected_len"):
        cache.cache_finished_req(r.tokens, r.slots, 2, r.node)
    finish(cache, r)
    check_integrity(alloc, cache, 0)


@pytest.mark.parametrize("P", [1, 4])
def test_cache_unfinished_req_shares_a_running_prefill(P):
    alloc, cache = make(64, P)
    prompt = list(range(5 * P + 1))
    r = start(cache, prompt[:2 * P + 1])  # first chunk
    aligned = (2 * P + 1) // P * P
    res = cache.cache_unfinished_req(r.tokens, r.slots, r.cache_protected_len, r.node)
    assert res.slots == r.slots[:aligned]
    r.slots, r.cache_protected_len, r.node = res.slots + r.slots[aligned:], len(res.slots), res.node
    assert cache.protected_pages == aligned // P
    check_integrity(alloc, cache, in_use([r], P))

    # Another request can reuse the chunk already computed while r keeps running.
    other = start(cache, prompt[:2 * P] + [7] * P)
    assert other.cache_protected_len == 2 * P and other.slots[:2 * P] == r.slots[:2 * P]

    # Second chunk: r first fills its partial page, then takes new ones.
    assert extend(cache, r, prompt[len(r.tokens):])
    res = cache.cache_unfinished_req(r.tokens, r.slots, r.cache_protected_len, r.node)
    aligned = len(prompt) // P * P
    assert len(res.slots) == aligned and res.slots == r.slots[:aligned]
    r.slots, r.cache_protected_len, r.node = res.slots + r.slots[aligned:], len(res.slots), res.node
    check_integrity(alloc, cache, in_use([r, other], P))

    finish(cache, other)
    finish(cache, r)
    check_integrity(alloc, cache, 0)
    assert cache.protected_pages == 0
    assert cache.match_prefix(prompt).slots == r.slots[:aligned]
    assert cache.reset() and alloc.num_free_pages == 64


# ---- integrity check --------------------------------------------------------------------------------


def test_check_integrity_reports_leaks_and_corruption():
    alloc, cache = make(8, 2)
    r = start(cache, [1, 2, 3, 4, 5])
    with pytest.raises(RuntimeError, match=r"free 5 \+ cached 0 \+ in use 0 != total 8"):
        check_integrity(alloc, cache, 0)
    finish(cache, r)
    check_integrity(alloc, cache, 0)
    (node,) = cache.root.children.values()

    good = node.value
    free_page = next(p for p in range(8) if alloc.is_free(p))
    node.value = [2 * free_page, 2 * free_page + 1] + good[2:]  # totals still balance
    with pytest.raises(RuntimeError, match="both free and cached"):
        check_integrity(alloc, cache, 0)
    node.value = good[2:] + good[2:]
    with pytest.raises(RuntimeError, match="cached twice"):
        check_integrity(alloc, cache, 0)
    node.value = good
    check_integrity(alloc, cache, 0)

    node.lock_ref = -1
    with pytest.raises(RuntimeError, match="negative lock_ref"):
        check_integrity(alloc, cache, 0)
    node.lock_ref = 1  # without going through inc_lock_ref the counters disagree
    with pytest.raises(RuntimeError, match="counters"):
        check_integrity(alloc, cache, 0)
    node.lock_ref = 0
    node.value = [0, 2, 4, 5]
    with pytest.raises(RuntimeError, match="not one whole page"):
        check_integrity(alloc, cache, 0)


# ---- no prefix cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 4])
def test_no_prefix_cache_frees_everything(P):
    alloc = PageAllocator(16, P)
    cache = NoPrefixCache(alloc)
    tokens = list(range(3 * P + 1))
    r1, r2 = start(cache, tokens), start(cache, tokens)
    assert r1.cache_protected_len == 0 and r2.cache_protected_len == 0
    check_integrity(alloc, cache, in_use([r1, r2], P))
    res = cache.cache_unfinished_req(r1.tokens, r1.slots, r1.cache_protected_len, r1.node)
    assert res.slots == [] and alloc.num_free_pages == 16 - 8
    finish(cache, r1)
    finish(cache, r2)
    assert alloc.num_free_pages == 16
    assert cache.match_prefix(tokens).slots == []
    pages = alloc.alloc(1)
    assert cache.insert(tokens[:P], slots_for(pages, P, 0, P)) == 0
    assert alloc.num_free_pages == 16
    assert (cache.evict(5), cache.cached_pages, cache.reset()) == (0, 0, True)
    assert cache.hit_stats() == (0, 3 * (3 * P + 1)) and cache.hit_rate == 0.0
    check_integrity(alloc, cache, 0)


# ---- randomized stress ------------------------------------------------------------------------------


def _check_kv(kv: dict[int, tuple[int, ...]], tokens: list[int], slots: list[int], upto: int) -> None:
    """Every slot must hold the 'KV' of exactly its own prefix, i.e. sharing never mixes contexts."""
    for i in range(upto):
        assert kv[slots[i]] == tuple(tokens[:i + 1]), f"slot {slots[i]} at position {i} holds the wrong KV"


@pytest.mark.parametrize("P", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_stress(P, seed):
    rng = random.Random(seed)
    num_pages = 48
    alloc, cache = make(num_pages, P)
    kv: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose KV it holds
    running: list[Req] = []
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(0, 12))] for _ in range(4)]

    def alloc_pages(n: int) -> list[int] | None:
        if n > alloc.num_free_pages:
            cache.evict(n - alloc.num_free_pages)
        return alloc.alloc(n)

    def write_kv(r: Req, frm: int) -> None:
        for i in range(frm, len(r.tokens)):
            kv[r.slots[i]] = tuple(r.tokens[:i + 1])

    for _step in range(400):
        action = rng.random()
        if not running and action < 0.95:
            action *= 0.35  # nothing running: start something
        if action < 0.35 and len(running) < 6:
            tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 10))]
            m = cache.match_prefix(tokens)
            _check_kv(kv, tokens, m.slots, len(m.slots))
            cache.inc_lock_ref(m.node)
            n_new = len(tokens) - len(m.slots)
            pages = alloc_pages(-(-n_new // P))
            if pages is None:
                cache.dec_lock_ref(m.node)  # would wait in the queue
            else:
                r = Req(tokens, m.slots + slots_for(pages, P, 0, n_new), len(m.slots), m.node)
                write_kv(r, len(m.slots))
                running.append(r)
        elif 0.35 <= action < 0.6 and running:
            r = rng.choice(running)
            old = len(r.tokens)
            if extend(cache, r, [rng.randrange(3) for _ in range(rng.randint(1, 2 * P))]):
                write_kv(r, old)
            else:
                running.remove(r)  # retract: give everything back
                finish(cache, r)
        elif 0.6 <= action < 0.7 and running:
            r = rng.choice(running)
            res = cache.cache_unfinished_req(r.tokens, r.slots, r.cache_protected_len, r.node)
            r.slots, r.cache_protected_len, r.node = res.slots + r.slots[len(res.slots):], len(res.slots), res.node
        elif 0.7 <= action < 0.95 and running:
            r = running.pop(rng.randrange(len(running)))
            finish(cache, r)
        elif 0.95 <= action < 0.97:
            assert cache.reset() == (not any(r.cache_protected_len for r in running))  # only locks block a flush
        elif action >= 0.97:
            cache.evict(rng.randint(1, 5))

        check_integrity(alloc, cache, in_use(running, P))
        owned = [p for r in running for p in r.own_pages(P)]
        assert len(owned) == len(set(owned)), "two requests own the same page"
        assert not any(alloc.is_free(p) for p in owned)
        for r in running:
            _check_kv(kv, r.tokens, r.slots, len(r.tokens))

    for r in running:
        finish(cache, r)
    check_integrity(alloc, cache, 0)
    assert cache.protected_pages == 0
    assert cache.reset() is True
    assert alloc.num_free_pages == num_pages and cache.cached_pages == 0
    matched, queried = cache.hit_stats()
    assert 0 < matched <= queried


def test_reset_keeps_the_root_valid_for_requests_that_matched_nothing():
    alloc, cache = make(16, 2)
    cache_seq(cache, [1, 2, 3, 4])
    r = start(cache, [9, 9, 9])  # matched nothing: holds the root, locks nothing
    assert r.node is cache.root
    assert cache.reset() is True
    check_integrity(alloc, cache, in_use([r], 2))
    finish(cache, r)
    assert cache.cached_pages == 1 and alloc.num_free_pages == 15  # its one whole page [9, 9] is cached
    check_integrity(alloc, cache, 0)


def test_lock_on_a_node_from_another_tree_is_rejected():
    alloc, cache = make(8, 1)
    _, other = make(8, 1)
    with pytest.raises(RuntimeError, match="not part of this cache"):
        cache.inc_lock_ref(other.root)
