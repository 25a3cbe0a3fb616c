"""Data-parallel replicas behind one API process: which replica serves a request (`--dp-size`).

Each replica is a scheduler process with its own KV pool and radix cache. The API process keeps a mirror of
every replica's cache, rebuilt from the insert and evict events the replica publishes with its outputs
(`RadixCache.events`), plus the prompts it has sent there and not seen finish (they will be cached once
their prefill runs). So the longest cached prefix of a prompt on each replica is known exactly, where
SGLang's and vLLM's routers only guess it from the text they routed before.

The policy is SGLang's cache-aware one (sgl-router's defaults as starting points):
* when the loads (sequences in flight) are imbalanced, `max - min > 64` and `max > 1.5 x min`, the
  least-loaded replica;
* else the replica holding the longest prefix of the prompt, when that prefix is at least 30% of it;
* else the least-loaded replica.
Ties go to the less loaded replica, then the one caching less, then the lower rank. `round_robin` and
`shortest_queue` are there for comparison (`--load-balance-method`).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

METHODS = ("cache_aware", "round_robin", "shortest_queue")
CACHE_THRESHOLD = 0.3  # sgl-router's --cache-threshold default
BALANCE_ABS_THRESHOLD = 64  # sgl-router's --balance-abs-threshold
BALANCE_REL_THRESHOLD = 1.5  # sgl-router's --balance-rel-threshold


class NoReplicaError(Exception):
    """No replica can take a request (all of them are down or restarting)."""


class _Node:
    __slots__ = ("children", "count", "key", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.count = 0


def _common(key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
    """Length of the common prefix of `key` and tokens[pos:] (compared in C, halving on a mismatch)."""
    n = min(len(key), len(tokens) - pos)
    if key[:n] == tokens[pos:pos + n]:
        return n
    lo, hi = 1, n - 1  # key[0] matched (it is the child's dict key); the prefix of length n did not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[:mid] == tokens[pos:pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixMirror:
    """A radix tree of token ids: what one replica's prefix cache holds (or, counted, what it is sent).

    Unlike `RadixCache` it holds no KV and knows no pages: only which token sequences are there.
    With `counted`, each `insert` is one reference along its path and `release` drops it; nodes without
    references go (the prompts in flight). Without it, `remove` mirrors the replica's evictions.
    """

    def __init__(self, counted: bool = False) -> None:
        self.counted = counted
        self.root = _Node((), None)
        self.tokens = 0  # tokens held (the sum of the node keys' lengths)

    def clear(self) -> None:
        self.root = _Node((), None)
        self.tokens = 0

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens; returns the new upper node."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = _Node(node.key[:at], parent)
        upper.count = node.count
        parent.children[upper.key[0]] = upper
        node.key, node.parent = node.key[at:], upper
        upper.children[node.key[0]] = node
        return upper

    def insert(self, tokens: Sequence[int]) -> None:
        seq = tuple(tokens)
        node, pos = self.root, 0
        while pos < len(seq):
            child = node.children.get(seq[pos])
            if child is None:
                child = _Node(seq[pos:], node)
                node.children[seq[pos]] = child
                self.tokens += len(child.key)
                child.count += 1
                return
            k = _common(child.key, seq, pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.count += 1
            node, pos = child, pos + k

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the tree holds."""
        seq = tokens if isinstance(tokens, tuple) else tuple(tokens)
        node, pos = self.root, 0
        while pos < len(seq):
            child = node.children.get(seq[pos])
            if child is None:
                break
            k = _common(child.key, seq, pos)
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def _drop(self, node: _Node) -> None:
        """Remove `node` and everything below it."""
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            n = stack.pop()
            self.tokens -= len(n.key)
            stack.extend(n.children.values())

    def _whole_path(self, tokens: Sequence[int]) -> list[tuple[_Node, int]] | None:
        """The nodes that spell exactly `tokens`, each with the depth it starts at; None when the tree does not
        hold `tokens` as whole nodes."""
        seq = tuple(tokens)
        path: list[tuple[_Node, int]] = []
        node, pos = self.root, 0
        while pos < len(seq):
            child = node.children.get(seq[pos])
            if child is None or _common(child.key, seq, pos) < len(child.key):
                return None
            path.append((child, pos))
            node, pos = child, pos + len(child.key)
        return path

    def remove(self, tokens: Sequence[int], keep: int) -> None:
        """The replica evicted tokens[keep:], the tail of one of its leaves: drop what only that tail holds.
        A node of the tail that other sequences still pass through stays (in a token trie, sibling pages that
        begin with the same tokens share a node)."""
        # Not held as a whole path: nothing to do (or the mirror is behind; it heals on insert).
        for node, start in reversed(self._whole_path(tokens) or []):
            if node.children or start + len(node.key) <= keep:
                return
            if start >= keep:
                self._drop(node)
            else:
                self.tokens -= len(node.key) - (keep - start)
                node.key = node.key[:keep - start]
                return

    def release(self, tokens: Sequence[int]) -> None:
        """Drop one `insert` of exactly these tokens (counted trees): a node no sequence passes through any more
        goes, with what is below it."""
        for node, _ in self._whole_path(tokens) or []:
            node.count -= 1
            if node.count <= 0:
                self._drop(node)
                return

    def apply(self, event: Sequence[Any]) -> None:
        """One event of a replica's cache: ["+", tokens] stored, ["-", tokens, keep] evicted past keep,
        ["0"] emptied."""
        op = event[0]
        if op == "+":
            self.insert(event[1])
        elif op == "-":
            self.remove(event[1], int(event[2]))
        elif op == "0":
            self.clear()


class DataParallelDispatcher:
    """Picks the replica of each prompt and keeps the per-replica state that decides it."""

    def __init__(self, dp_size: int, method: str = "cache_aware", cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown load-balance method {method!r}; choose one of {', '.join(METHODS)}")
        self.dp_size = dp_size
        self.method = method
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cached = [PrefixMirror() for _ in range(dp_size)]
        self.pending = [PrefixMirror(counted=True) for _ in range(dp_size)]
        self.load = [0] * dp_size  # sequences in flight on each replica
        self.alive = [True] * dp_size
        self.dispatched = [0] * dp_size  # sequences sent to each replica, ever
        self.reasons: collections.Counter[str] = collections.Counter()
        self._rr = itertools.count()

    def live(self) -> list[int]:
        return [r for r in range(self.dp_size) if self.alive[r]]

    def _least_loaded(self, live: list[int]) -> int:
        """Fewest sequences in flight; on a tie the smaller cache (sgl-router's choice below its threshold), so
        that new prefixes spread over the replicas' memory."""
        return min(live, key=lambda r: (self.load[r], self.cached[r].tokens, r))

    def choose(self, tokens: Sequence[int]) -> int:
        """The replica for a prompt of these token ids. Raises NoReplicaError when none is up."""
        live = self.live()
        if not live:
            raise NoReplicaError("no replica is up (they are restarting or have died)")
        if len(live) == 1:
            return self._pick(live[0], "only_replica")
        if self.method == "round_robin":
            return self._pick(live[next(self._rr) % len(live)], "round_robin")
        least = self._least_loaded(live)
        if self.method == "shortest_queue":
            return self._pick(least, "shortest_queue")
        loads = [self.load[r] for r in live]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return self._pick(least, "imbalanced")
        seq = tuple(tokens)
        best, best_len = least, -1
        for r in live:
            matched = max(self.cached[r].match(seq), self.pending[r].match(seq))
            if matched > best_len or (matched == best_len and (self.load[r], r) < (self.load[best], best)):
                best, best_len = r, matched
        if seq and best_len > 0 and best_len >= self.cache_threshold * len(seq):
            return self._pick(best, "prefix")
        return self._pick(least, "least_loaded")

    def _pick(self, rank: int, reason: str) -> int:
        self.reasons[reason] += 1
        return rank

    def on_dispatch(self, rank: int, tokens: Sequence[int]) -> None:
        """A sequence with this prompt was sent to `rank`."""
        self.load[rank] += 1
        self.dispatched[rank] += 1
        self.pending[rank].insert(tokens)

    def on_finish(self, rank: int, tokens: Sequence[int]) -> None:
        """A sequence sent to `rank` finished (or was failed)."""
        self.load[rank] = max(0, self.load[rank] - 1)
        self.pending[rank].release(tokens)

    def on_events(self, rank: int, events: Sequence[Sequence[Any]]) -> None:
        mirror = self.cached[rank]
        for event in events:
            mirror.apply(event)

    def set_alive(self, rank: int, alive: bool) -> None:
        """A replica went down (its cache is gone with it) or came back (empty)."""
        self.alive[rank] = alive
        self.cached[rank].clear()
        if not alive:
            self.pending[rank].clear()
            self.load[rank] = 0

    def info(self) -> dict[str, Any]:
        return {"load_balance_method": self.method, "dispatch_reasons": dict(self.reasons)}


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (Linux's cpu-list format). ValueError when malformed."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in CPU list {text!r}")
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.extend(range(first, last + 1))
    return cpus


def replica_cpu_sets(dp_size: int, spec: str | None, available: Sequence[int]) -> list[list[int]]:
    """The CPUs of each replica: `--dp-cpus "0-15;16-31"` (one list per replica, disjoint), or the available
    CPUs split into `dp_size` contiguous, near-equal runs. ValueError with a one-line reason."""
    available = sorted(available)
    if spec is not None:
        parts = spec.split(";")
        if len(parts) != dp_size:
            raise ValueError(f"--dp-cpus gives {len(parts)} CPU set(s) for --dp-size {dp_size}; give one per replica, "
                             "separated by ';'")
        sets = [parse_cpu_list(p) for p in parts]
        seen: set[int] = set()
        for i, cpus in enumerate(sets):
            if seen & set(cpus):
                raise ValueError(f"--dp-cpus: replica {i}'s CPUs {sorted(seen & set(cpus))} are also another "
                                 "replica's; the sets must be disjoint")
            seen |= set(cpus)
        missing = sorted(seen - set(available))
        if missing:
            raise ValueError(f"--dp-cpus names CPUs {missing} that this process may not run on (it may use "
                             f"{format_cpu_list(available)})")
        return sets
    if dp_size > len(available):
        raise ValueError(f"--dp-size {dp_size} needs at least one CPU a replica, but this process may use "
                         f"{len(available)} ({format_cpu_list(available)})")
    base, extra = divmod(len(available), dp_size)
    sets, start = [], 0
    for i in range(dp_size):
        n = base + (1 if i < extra else 0)
        sets.append(available[start:start + n])
        start += n
    return sets


def format_cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(cpus)), key=lambda t: t[1] - t[0]):
        values = [v for _, v in run]
        out.append(f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0]))
    return ",".join(out)
