"""What rank 0 sends the other TP ranks each step: only what changed (vLLM's NewRequestData/CachedRequestData).

A `StepInput` carries each request's whole KV slot list (`kv_indices`) and, in its sampling rows, each one's
prompt and output ids. Sent whole, a decode step with 32 requests of 1,000 tokens is ~100k integers, every step,
over the network when the ranks are on other hosts. But from one step to the next a running request's slot list
only grows by the slots of its new tokens (or loses rejected draft slots), and the followers never sample
unless the LM-head all-to-all shares the sampling out.

So the followers keep each request's slot list (their block table), keyed by `StepInput.row_keys`, and rank 0
sends, for each row: how many leading slots of the follower's list to keep, and the slots after them. A key
absent from a step is forgotten on both sides. Correctness never depends on the keys: the kept length is the
true common prefix of the old and new lists, so a reused key only costs bytes. Sampling rows go as a count
unless the followers sample (`rows_needed`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from servelm.managers.schedule_batch import StepInput

FULL_STEPS_ENV = "SERVELM_TP_FULL_STEPS"  # "1": send every StepInput whole (the baseline of the measurement)


@dataclass
class CompactStep:
    """A StepInput without the parts the followers already hold."""

    input_ids: list[int]
    positions: list[int]
    out_cache_loc: list[int]
    extend_lens: list[int]
    kv: list[tuple[Any, int, list[int]]]  # (row key, slots kept from the follower's list, slots after them)
    logits_indices: list[int]
    num_rows: int
    sample_rows: list[Any] | None = None  # whole, only when the followers sample
    hidden_indices: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token (or slot) lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a list grew), compared in C
        return n
    lo, hi = 0, n - 1  # the prefix of length n differs: the longest equal one, halving
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class StepEncoder:
    """Rank 0's side: turns each StepInput into a CompactStep against what the followers hold."""

    def __init__(self, rows_needed: bool) -> None:
        self.rows_needed = rows_needed
        self.full = os.environ.get(FULL_STEPS_ENV) == "1"
        self._tables: dict[Any, list[int]] = {}

    def encode(self, step: StepInput) -> Any:
        if self.full or not isinstance(step, StepInput) or len(step.row_keys) != len(step.kv_indices):
            return step
        tables: dict[Any, list[int]] = {}
        kv = []
        for key, slots in zip(step.row_keys, step.kv_indices, strict=True):
            old = self._tables.get(key)
            keep = common_prefix(old, slots) if old is not None else 0
            kv.append((key, keep, slots[keep:]))
            tables[key] = list(slots)  # a copy: the scheduler extends a request's own list in place
        self._tables = tables
        return CompactStep(step.input_ids, step.positions, step.out_cache_loc, step.extend_lens, kv,
                           step.logits_indices, len(step.sample_rows),
                           step.sample_rows if self.rows_needed else None, step.hidden_indices)


class StepDecoder:
    """A follower's side: rebuilds the StepInput (its sampling rows as placeholders when it does not sample)."""

    def __init__(self) -> None:
        self._tables: dict[Any, list[int]] = {}

    def decode(self, msg: Any) -> StepInput:
        if not isinstance(msg, CompactStep):
            return msg
        tables: dict[Any, list[int]] = {}
        kv_indices = []
        for key, keep, tail in msg.kv:
            old = self._tables.get(key) if keep else None
            if old is not None and keep == len(old):
                old.extend(tail)  # the usual case: the request's list grew (ours; the last step is done with it)
                slots = old
            else:
                slots = (old[:keep] + tail) if old is not None else tail
            tables[key] = slots
            kv_indices.append(slots)
        self._tables = tables
        rows = msg.sample_rows if msg.sample_rows is not None else [None] * msg.num_rows
        return StepInput(msg.input_ids, msg.positions, msg.out_cache_loc, msg.extend_lens, kv_indices,
                         msg.logits_indices, rows, msg.hidden_indices, [key for key, _, _ in msg.kv])
