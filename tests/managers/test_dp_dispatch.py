"""The data-parallel dispatcher without a model: the mirror of a replica's radix cache, built from the cache's own
events, answers every prefix query as the cache does; the policy; the replicas' CPU sets."""

from __future__ import annotations

import random

import pytest

from servelm.managers.dp_dispatch import (
    DataParallelDispatcher,
    NoReplicaError,
    PrefixMirror,
    format_cpu_list,
    parse_cpu_list,
    replica_cpu_sets,
)
from servelm.mem_cache.allocator import PageAllocator
from servelm.mem_cache.radix_cache import RadixCache


def _cache_content(cache: RadixCache) -> set[tuple[int, ...]]:
    """Every token sequence the cache holds, as the set of all its prefixes."""
    out: set[tuple[int, ...]] = set()
    for node in cache.iter_nodes():
        path = tuple(cache._path(node))
        out.update(path[:i] for i in range(len(path) - len(node.key) + 1, len(path) + 1))
    return out


def _mirror_content(mirror: PrefixMirror) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    stack = [(mirror.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = prefix + child.key
            out.update(path[:i] for i in range(len(prefix) + 1, len(path) + 1))
            stack.append((child, path))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mirror_follows_the_radix_cache_through_inserts_evictions_and_resets(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    allocator = PageAllocator(num_pages=64, page_size=page_size)
    cache = RadixCache(allocator)
    cache.events = []
    mirror = PrefixMirror()
    stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 12) * page_size)] for _ in range(6)]
    for step in range(400):
        op = rng.random()
        if op < 0.6:  # a request finishes: its page-aligned tokens go into the tree
            tokens = rng.choice(stems)[:rng.randrange(1, 4) * page_size]
            tokens = tokens + [rng.randrange(5) for _ in range(rng.randrange(0, 3) * page_size)]
            pages = len(tokens) // page_size
            if allocator.num_free_pages < pages:
                cache.evict(pages - allocator.num_free_pages)
            if allocator.num_free_pages < pages:
                continue
            slots = [p * page_size + i for p in allocator.alloc(pages) for i in range(page_size)]
            already = cache.insert(tokens, slots)
            allocator.free(sorted({s // page_size for s in slots[:already]}))
        elif op < 0.9:
            cache.evict(rng.randrange(1, 8))
        elif op < 0.93:
            assert cache.reset()
        else:  # a lookup splits nodes and moves the LRU clock; neither changes what is cached
            cache.match_prefix(rng.choice(stems))
        events, cache.events = cache.events, []
        for event in events:
            mirror.apply(event)
        content = _mirror_content(mirror)
        assert content == _cache_content(cache), f"step {step}"
        # Its token count is that of a token trie: sibling pages that share their first tokens share them.
        assert mirror.tokens == len(content)
        if page_size == 1:
            assert mirror.tokens == cache.cached_pages
        query = rng.choice(stems) + [rng.randrange(5)]
        assert mirror.match(query) // page_size * page_size == len(cache.match_prefix(query).slots)
        cache.events.clear()  # match_prefix records nothing, but keep the stream exact anyway


def test_counted_mirror_holds_the_prompts_in_flight() -> None:
    rng = random.Random(7)
    mirror = PrefixMirror(counted=True)
    live: list[list[int]] = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            mirror.release(live.pop(rng.randrange(len(live))))
        else:
            seq = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            mirror.insert(seq)
            live.append(seq)
        query = [rng.randrange(3) for _ in range(10)]
        best = max((next((i for i, (a, b) in enumerate(zip(s, query, strict=False)) if a != b), min(len(s), 10))
                    for s in live), default=0)
        assert mirror.match(query) == best
    for seq in live:
        mirror.release(seq)
    assert mirror.tokens == 0 and not mirror.root.children


def test_remove_keeps_other_branches_and_ignores_paths_it_does_not_hold() -> None:
    mirror = PrefixMirror()
    mirror.insert([1, 2, 3, 4])
    mirror.insert([1, 2, 9])
    mirror.remove([1, 2, 3, 4], 3)  # the tail [4] of the leaf [3, 4]
    assert mirror.match([1, 2, 3, 4]) == 3 and mirror.match([1, 2, 9]) == 3
    mirror.remove([1, 2, 3], 2)  # the whole leaf [3]
    assert mirror.match([1, 2, 3]) == 2 and mirror.match([1, 2, 9]) == 3
    mirror.remove([7, 7], 0)
    mirror.remove([1, 5, 5], 2)  # leaves the tree before the cut
    assert mirror.tokens == 3
    mirror.apply(["0"])
    assert mirror.tokens == 0 and mirror.match([1, 2]) == 0


def _dispatcher(n: int = 2, **kw: object) -> DataParallelDispatcher:
    return DataParallelDispatcher(n, **kw)  # type: ignore[arg-type]


def test_cache_aware_sends_a_prompt_to_the_replica_holding_its_prefix() -> None:
    d = _dispatcher(3)
    system = list(range(100))
    d.on_events(2, [["+", system + [500, 501]]])
    d.load[2] = 5  # busier, but within the balance thresholds
    assert d.choose(system + [7, 8, 9]) == 2
    assert d.reasons["prefix"] == 1
    # Below the threshold (30% of the prompt): the least-loaded replica, the smaller cache on a tie.
    assert d.choose(system[:10] + list(range(1000, 1100))) == 0
    d.on_events(0, [["+", [42] * 50]])
    assert d.choose([9, 9, 9]) == 1
    assert d.reasons["least_loaded"] == 2


def test_prompts_in_flight_count_as_cached_and_finished_ones_leave() -> None:
    d = _dispatcher(2)
    prompt = list(range(64))
    first = d.choose(prompt)
    d.on_dispatch(first, prompt)
    assert d.load[first] == 1
    assert d.choose(prompt + [1, 2]) == first  # not cached yet, but on its way there
    d.on_finish(first, prompt)
    assert d.load[first] == 0 and d.pending[first].tokens == 0
    assert d.choose(prompt) == 0  # nothing left: least loaded, lowest rank


def test_imbalanced_loads_override_the_prefix() -> None:
    d = _dispatcher(2)
    prompt = list(range(50))
    d.on_events(0, [["+", prompt]])
    d.load[0], d.load[1] = 100, 20  # gap 80 > 64 and 100 > 1.5 x 20
    assert d.choose(prompt) == 1 and d.reasons["imbalanced"] == 1
    d.load[0] = 60  # gap 40: balanced enough, the prefix wins
    assert d.choose(prompt) == 0


def test_round_robin_shortest_queue_and_dead_replicas() -> None:
    d = _dispatcher(3, method="round_robin")
    assert [d.choose([1]) for _ in range(4)] == [0, 1, 2, 0]
    d.set_alive(1, False)
    assert [d.choose([1]) for _ in range(4)] == [0, 2, 0, 2]
    q = _dispatcher(2, method="shortest_queue")
    q.on_events(0, [["+", [1, 2, 3]]])
    q.load[0] = 1
    assert q.choose([1, 2, 3]) == 1
    q.set_alive(0, False)
    q.set_alive(1, False)
    with pytest.raises(NoReplicaError):
        q.choose([1])
    with pytest.raises(ValueError, match="unknown load-balance method"):
        _dispatcher(2, method="random")


def test_a_replica_that_went_down_comes_back_empty() -> None:
    d = _dispatcher(2)
    d.on_events(1, [["+", [5] * 40]])
    d.on_dispatch(1, [5] * 40)
    d.set_alive(1, False)
    assert d.load[1] == 0 and d.cached[1].tokens == 0 and d.pending[1].tokens == 0
    assert d.choose([5] * 40) == 0
    d.set_alive(1, True)
    assert d.live() == [0, 1]


def test_cpu_lists_and_replica_cpu_sets() -> None:
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert replica_cpu_sets(2, None, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert replica_cpu_sets(2, "0-1;2-3", range(8)) == [[0, 1], [2, 3]]
    for spec, dp, cpus, message in [
        ("0-1", 2, range(4), "gives 1 CPU set"),
        ("0-1;1-2", 2, range(4), "also another replica's"),
        ("0;9", 2, range(4), "names CPUs \\[9\\]"),
        ("0;x", 2, range(4), "invalid literal"),
        (None, 3, [0, 1], "needs at least one CPU a replica"),
        ("3-1;0", 2, range(4), "bad CPU range"),
    ]:
        with pytest.raises(ValueError, match=message):
            replica_cpu_sets(dp, spec, list(cpus))


def test_replicas_are_the_servers_the_offline_engine_refuses_them() -> None:
    from servelm.config import ConfigError, ServerArgs
    from servelm.entrypoints.engine import Engine

    with pytest.raises(ValueError, match="the offline Engine runs one replica"):
        Engine(dp_size=2)
    for kwargs, message in [({"dp_size": 0}, "--dp-size must be >= 1"),
                            ({"dp_size": 2, "nnodes": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "is not supported"),
                            ({"dp_size": 2, "prefix_cache_dir": "/tmp/x"}, "needs --dp-size 1"),
                            ({"dp_cpus": "0;1"}, "--dp-cpus needs --dp-size > 1")]:
        with pytest.raises(ConfigError, match=message):
            ServerArgs(**kwargs)
