"""Deterministic-inference switch (`--enable-deterministic-inference`).

When on, every per-row computation must give bit-identical results whatever
else shares the batch, however prefill is chunked, and whether a prefix came
from the radix cache. Layers consult `is_batch_invariant()`.
"""

from __future__ import annotations

_ENABLED = False


def set_batch_invariant(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = bool(enabled)


def is_batch_invariant() -> bool:
    return _ENABLED
