"""Prefix-cache policies over the paged KV pool: a radix tree (RadixCache) or none (NoPrefixCache).

The tree maps token ids to the KV slots that hold their keys/values, so a new
request whose prompt starts like an earlier one reuses that KV instead of
recomputing it. Everything is page aligned: every node's key length is a
multiple of `page_size` and its value is whole pages, which is why nodes only
ever split at page boundaries and a match is truncated to whole pages.

Ownership (NOTE: the invariant `check_integrity` verifies): every page is
exactly one of free (in the allocator), cached (in the tree) or in use (owned
by a running request). A request borrows tree pages through `match_prefix` +
`inc_lock_ref` and gives back its own pages through `cache_finished_req`.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from servelm.mem_cache.allocator import PageAllocator, pages_of

__all__ = ["BasePrefixCache", "MatchResult", "NoPrefixCache", "RadixCache", "TreeNode", "check_integrity"]

_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree: a run of tokens (`key`) and their KV slots (`value`)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(self, parent: TreeNode | None, key: tuple[int, ...], value: list[int], now: int) -> None:
        # Children are keyed by their first page of tokens: siblings always differ there.
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        # Locks are path locks: a node's lock_ref is the number of requests using it or a descendant.
        self.lock_ref = 0
        self.last_access = now
        self.id = next(_node_ids)  # tie-break for LRU ordering

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass
class MatchResult:
    """A cached prefix: `slots` (length a multiple of page_size) and the tree node where it ends."""

    slots: list[int]
    node: TreeNode


class BasePrefixCache(ABC):
    """The prefix-cache interface the scheduler codes against."""

    allocator: PageAllocator

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `token_ids`. Does not lock it."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Cache page-aligned KV; returns how many leading tokens were already cached (caller frees those)."""

    @abstractmethod
    def cache_finished_req(self, token_ids: Sequence[int], slots: Sequence[int], cache_protected_len: int,
                           node: TreeNode) -> None:
        """Take back everything a finished (or retracted) request holds; see RadixCache for details."""

    @abstractmethod
    def cache_unfinished_req(self, token_ids: Sequence[int], slots: Sequence[int], cache_protected_len: int,
                             node: TreeNode) -> MatchResult:
        """Share a running request's KV so far; see RadixCache for details."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unlocked cached pages; returns how many were freed."""

    @abstractmethod
    def reset(self) -> bool:
        """Drop the whole cache; False (and nothing done) if a request still locks part of it."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Cached pages no request locks."""

    @property
    @abstractmethod
    def protected_pages(self) -> int:
        """Cached pages locked by running requests."""

    @property
    def cached_pages(self) -> int:
        """All pages owned by the cache."""
        return self.evictable_pages + self.protected_pages

    # Hit-rate counters (monotonic, like Prometheus counters; `reset` keeps them).
    total_matched_tokens: int = 0
    total_queried_tokens: int = 0

    def hit_stats(self) -> tuple[int, int]:
        """(total matched tokens, total queried tokens) over all `match_prefix` calls."""
        return self.total_matched_tokens, self.total_queried_tokens

    @property
    def hit_rate(self) -> float:
        return self.total_matched_tokens / self.total_queried_tokens if self.total_queried_tokens else 0.0

    def _free_own_pages(self, slots: Sequence[int], start: int, end: int) -> None:
        """Free the request-owned pages covering slots[start:end] (start page aligned, end rounded up)."""
        if end > start:
            self.allocator.free(pages_of(slots[start:end], self.page_size))


class RadixCache(BasePrefixCache):
    """Radix tree over page-aligned token runs, evicting unlocked leaves in LRU order."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self._clock = 0  # logical time: deterministic LRU, no ties from a coarse wall clock
        self.total_matched_tokens = 0
        self.total_queried_tokens = 0
        # NOTE: the root outlives `reset`, so requests that matched nothing may keep holding it.
        self.root = TreeNode(None, (), [], 0)
        self.root.lock_ref = 1  # the root holds no pages and is never evicted
        # With data-parallel replicas, what the tree gains and loses, for the API process's mirror of it
        # (servelm.managers.dp_dispatch): ["+", tokens] stored, ["-", tokens, keep] evicted past `keep`,
        # ["0"] emptied. None (the default): nothing is recorded.
        self.events: list[list[Any]] | None = None
        self._init_tree()

    def _init_tree(self) -> None:
        self.root.children.clear()
        self._leaves: set[TreeNode] = set()  # non-root nodes without children
        self._evictable = 0
        self._protected = 0

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    # ---- lookup -------------------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _common_len(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """Length of the common page-aligned prefix of `key` and tokens[pos:]."""
        P = self.page_size
        n = min(len(key), len(tokens) - pos) // P * P
        if key[:n] == tokens[pos:pos + n]:  # the common case, compared in C
            return n
        i = P  # the first page matched already: it is the child's dict key
        while i < n and key[i:i + P] == tokens[pos + i:pos + i + P]:
            i += P
        return min(i, n)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child` after `at` tokens (a page boundary); returns the new upper node."""
        P = self.page_size
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key) and at % P == 0
        upper = TreeNode(parent, child.key[:at], child.value[:at], child.last_access)
        upper.lock_ref = child.lock_ref  # every lock through child also passes through upper
        parent.children[child.key[:P]] = upper
        child.key, child.value, child.parent = child.key[at:], child.value[at:], upper
        upper.children[child.key[:P]] = child
        return upper

    def _walk(self, tokens: tuple[int, ...]) -> tuple[TreeNode, int, list[int]]:
        """Follow `tokens` down the tree, splitting a partly matched node; returns (node, matched, slots)."""
        P = self.page_size
        now = self._tick()
        node, pos, slots = self.root, 0, []
        node.last_access = now
        while len(tokens) - pos >= P:
            child = node.children.get(tokens[pos:pos + P])
            if child is None:
                break
            k = self._common_len(child.key, tokens, pos)
            partial = k < len(child.key)
            if partial:
                child = self._split(child, k)
            child.last_access = now
            slots.extend(child.value)
            node, pos = child, pos + k
            if partial:
                break
        return node, pos, slots

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `token_ids`, truncated to whole pages.

        Splits a node the match ends inside so the returned node covers exactly
        the match (locking it then protects exactly those pages), and marks the
        path as recently used. Does NOT lock: call `inc_lock_ref(result.node)`
        before anything can evict.
        """
        node, matched, slots = self._walk(tuple(token_ids))
        self.total_matched_tokens += matched
        self.total_queried_tokens += len(token_ids)
        return MatchResult(slots, node)

    # ---- locking ------------------------------------------------------------------------------------

    def _parent(self, node: TreeNode) -> TreeNode:
        if node.parent is None:
            raise RuntimeError(f"{node!r} is not part of this cache's tree")
        return node.parent

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock root..node; pages on a newly locked node move from evictable to protected."""
        while node is not self.root:
            if node.lock_ref == 0:
                n = len(node.key) // self.page_size
                self._evictable -= n
                self._protected += n
            node.lock_ref += 1
            node = self._parent(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Unlock root..node (one `inc_lock_ref`); RuntimeError if it was not locked."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.key) // self.page_size
                self._evictable += n
                self._protected -= n
            node = self._parent(node)

    # ---- insertion ----------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Cache `slots` as the KV of `token_ids` (page aligned, equal lengths).

        Returns how many leading tokens were already cached: the caller's pages
        for that range are duplicates it must free. The tree owns the rest.
        """
        P = self.page_size
        if len(token_ids) != len(slots):
            raise ValueError(f"insert: {len(token_ids)} tokens but {len(slots)} slots")
        if len(token_ids) % P:
            raise ValueError(f"insert: length {len(token_ids)} is not a multiple of page_size {P}")
        tokens = tuple(token_ids)
        node, pos, _ = self._walk(tokens)
        if pos == len(tokens):
            return pos
        value = list(slots[pos:])
        for i in range(0, len(value), P):  # a misaligned value would corrupt other requests' KV
            if value[i] % P or value[i:i + P] != list(range(value[i], value[i] + P)):
                raise ValueError(f"insert: slots {value[i:i + P]} do not form one whole page")
        leaf = TreeNode(node, tokens[pos:], value, node.last_access)
        node.children[leaf.key[:P]] = leaf
        if self.events is not None:
            self.events.append(["+", list(tokens)])
        self._leaves.discard(node)
        self._leaves.add(leaf)
        self._evictable += len(value) // P
        return pos

    def cache_finished_req(self, token_ids: Sequence[int], slots: Sequence[int], cache_protected_len: int,
                           node: TreeNode) -> None:
        """Take back everything a finished (or retracted) request holds.

        slots[:cache_protected_len] came from `match_prefix` (tree-owned, locked via `node`);
        slots[cache_protected_len:] sit in pages the request owns, the last possibly partial.
        The page-aligned part is inserted, the request's duplicate pages and its
        trailing partial page are freed, and `node` is unlocked. `slots` may run
        past `token_ids` (pages reserved for tokens not computed yet): those
        pages are freed too.
        """
        aligned = self._insert_owned(token_ids, slots, cache_protected_len)
        self._free_own_pages(slots, aligned, len(slots))
        self.dec_lock_ref(node)

    def cache_unfinished_req(self, token_ids: Sequence[int], slots: Sequence[int], cache_protected_len: int,
                             node: TreeNode) -> MatchResult:
        """Cache a running request's page-aligned KV so far (chunked prefill), keeping it locked.

        Same arguments as `cache_finished_req`. Returns the new locked prefix
        (the old `node` is unlocked): the request continues with slots
        `result.slots + slots[len(result.slots):]` and cache_protected_len = len(result.slots);
        it still owns its trailing partial page.
        """
        aligned = self._insert_owned(token_ids, slots, cache_protected_len)
        new_node, matched, new_slots = self._walk(tuple(token_ids[:aligned]))
        if matched != aligned:
            raise RuntimeError(f"cache_unfinished_req: re-match found {matched} of {aligned} inserted tokens")
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(node)
        return MatchResult(new_slots, new_node)

    def _insert_owned(self, token_ids: Sequence[int], slots: Sequence[int], cache_protected_len: int) -> int:
        """Insert the page-aligned part of a request and free its duplicate pages; returns that length."""
        P = self.page_size
        if len(slots) < len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but only {len(slots)} slots")
        if cache_protected_len % P or not (0 <= cache_protected_len <= len(slots)):
            raise ValueError(f"cache_protected_len={cache_protected_len} must be page aligned and within the request")
        aligned = len(token_ids) // P * P
        already = self.insert(token_ids[:aligned], slots[:aligned])
        if already < cache_protected_len:
            # The locked prefix can neither be evicted nor shrink, so this means the caller broke the contract.
            raise RuntimeError(f"tree holds only {already} tokens of a locked {cache_protected_len}-token prefix")
        self._free_own_pages(slots, cache_protected_len, already)
        return aligned

    # ---- eviction -----------------------------------------------------------------------------------

    def _remove_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.key[:self.page_size]]
        self._leaves.discard(leaf)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages from unlocked leaves, least recently used first.

        A parent becomes a candidate once its last child is gone. The last leaf
        is trimmed from its tail rather than dropped whole, so exactly
        `num_pages` are freed when that many are evictable. Returns pages freed.
        """
        P = self.page_size
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            n = len(leaf.key) // P
            need = num_pages - freed
            keep = (n - need) * P if n > need else 0  # the tail is the least shareable part of a leaf
            if self.events is not None:
                path = self._path(leaf)
                self.events.append(["-", path, len(path) - len(leaf.key) + keep])
            if n > need:
                self.allocator.free(pages_of(leaf.value[keep:], P))
                leaf.key, leaf.value = leaf.key[:keep], leaf.value[:keep]
                self._evictable -= need
                freed += need
                break
            self.allocator.free(pages_of(leaf.value, P))
            self._evictable -= n
            freed += n
            self._remove_leaf(leaf)
            parent = leaf.parent
            if parent in self._leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def reset(self) -> bool:
        """Free every cached page; refuses (False) while any request holds a lock."""
        if self._protected:
            return False
        self.allocator.free([p for node in self.iter_nodes() for p in pages_of(node.value, self.page_size)])
        self._init_tree()
        if self.events is not None:
            self.events.append(["0"])
        return True

    def _path(self, node: TreeNode) -> list[int]:
        """The tokens from the root down to the end of `node`."""
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = self._parent(node)
        return [t for key in reversed(keys) for t in key]

    def iter_nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


class NoPrefixCache(BasePrefixCache):
    """The prefix cache turned off: nothing is shared, a finished request's pages go straight back."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.root = TreeNode(None, (), [], 0)
        self.total_matched_tokens = 0
        self.total_queried_tokens = 0

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        self.total_queried_tokens += len(token_ids)
        return MatchResult([], self.root)

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Nothing is cached: the pages are taken and freed at once (so callers' accounting holds)."""
        if len(token_ids) != len(slots) or len(slots) % self.page_size:
            raise ValueError("insert: token_ids and slots must have equal, page-aligned lengths")
        self._free_own_pages(slots, 0, len(slots))
        return 0

    def cache_finished_req(self, token_ids: Sequence[int], slots: Sequence[int], cache_protected_len: int,
                           node: TreeNode) -> None:
        self._free_own_pages(slots, cache_protected_len, len(slots))

    def cache_unfinished_req(self, token_ids: Sequence[int], slots: Sequence[int], cache_protected_len: int,
                             node: TreeNode) -> MatchResult:
        return MatchResult(list(slots[:cache_protected_len]), node)

    def evict(self, num_pages: int) -> int:
        return 0

    def reset(self) -> bool:
        return True

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def protected_pages(self) -> int:
        return 0


def check_integrity(allocator: PageAllocator, cache: BasePrefixCache, in_use_pages: int) -> None:
    """Raise RuntimeError unless free + cached + in_use == num_pages and the tree is consistent.

    `in_use_pages` counts pages owned by running requests (not by the tree).
    O(tree size): meant for tests and debug mode, not every scheduler step.
    """
    free, cached = allocator.num_free_pages, cache.cached_pages
    if free + cached + in_use_pages != allocator.num_pages:
        raise RuntimeError(f"KV page leak: free {free} + cached {cached} + in use {in_use_pages} "
                           f"!= total {allocator.num_pages}")
    if not isinstance(cache, RadixCache):
        return
    P = allocator.page_size
    errors: list[str] = []
    seen: set[int] = set()
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    for node in cache.iter_nodes():
        parent = node.parent
        if len(node.key) != len(node.value) or not node.key or len(node.key) % P:
            errors.append(f"{node!r}: key length {len(node.key)} / value length {len(node.value)} not whole pages")
            continue
        if parent is None or parent.children.get(node.key[:P]) is not node:
            errors.append(f"{node!r}: not registered under its first page in its parent")
        if node.lock_ref < 0:
            errors.append(f"{node!r}: negative lock_ref")
        elif parent is not cache.root and parent is not None and node.lock_ref > parent.lock_ref:
            errors.append(f"{node!r}: locked more than its parent (lock_ref {parent.lock_ref})")
        if not node.children:
            leaves.add(node)
        for i in range(0, len(node.value), P):
            page, start = node.value[i] // P, node.value[i]
            if start % P or node.value[i:i + P] != list(range(start, start + P)):
                errors.append(f"{node!r}: slots {node.value[i:i + P]} are not one whole page")
            elif page in seen:
                errors.append(f"page {page} is cached twice")
            elif allocator.is_free(page):
                errors.append(f"page {page} is both free and cached")
            seen.add(page)
        if node.lock_ref > 0:
            protected += len(node.key) // P
        else:
            evictable += len(node.key) // P
    if (evictable, protected) != (cache.evictable_pages, cache.protected_pages):
        errors.append(f"counters say evictable {cache.evictable_pages} / protected {cache.protected_pages}, "
                      f"tree holds {evictable} / {protected}")
    if leaves != cache._leaves:
        errors.append(f"leaf set out of date: {len(cache._leaves)} tracked, {len(leaves)} in the tree")
    if errors:
        raise RuntimeError("radix cache corrupted: " + "; ".join(errors[:10]))
