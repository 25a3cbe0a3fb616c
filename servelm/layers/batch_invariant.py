"""Deterministic-inference switch (`--enable-deterministic-inference`) and batch-invariant matmuls.

When on, every per-row computation must give bit-identical results whatever
else shares the batch, however prefill is chunked, and whether a prefix came
from the radix cache. Layers consult `is_batch_invariant()`.

Why probing: BLAS kernels (MKL, oneDNN) pick different code paths for small
or odd row counts, so a row's bits can depend on how many rows share the
call; which counts are safe depends on the library, its version, the CPU and
the thread count. So `RowRule.probe` checks each matmul shape on the machine
it runs on and picks a padding rule (or fixed row tiles). `silu_and_mul` is
the tail-free SiLU this mode needs. What was measured, kernel by kernel:
docs/measurements/batch-invariant-kernels.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_ENABLED = False


def set_batch_invariant(enabled: bool) -> None:
    """Turn the batch-invariant (deterministic) kernels on or off for this process."""
    global _ENABLED
    _ENABLED = bool(enabled)


def is_batch_invariant() -> bool:
    """Whether layers must use their batch-invariant paths."""
    return _ENABLED


RowFn = Callable[[torch.Tensor], torch.Tensor]

# Row counts probed: every small M (where BLAS libraries switch kernels and
# block rows) and both sides of each power of two (where blocking changes).
_SMALL = list(range(1, 18))
_MIN_ROW_CANDIDATES = (1, 2, 4, 8, 12, 16, 32)
_TILE_CANDIDATES = (16, 32, 64, 128)


def probe_sizes(max_rows: int) -> list[int]:
    """Row counts the probe tries, up to max_rows."""
    sizes = set(_SMALL)
    p = 32
    while p <= max_rows:
        sizes.update((p - 1, p, p + 1))
        p *= 2
    sizes.add(max_rows)
    return sorted(s for s in sizes if s <= max_rows)


@dataclass(frozen=True)
class RowRule:
    """How to call a row-wise matmul so each row's result does not depend on the other rows.

    `min_rows`: inputs with fewer rows are padded with zero rows up to this
    many. `max_rows`: larger inputs are processed in slabs of this many rows
    (the largest count the probe verified). `tile`: when set, every call
    gets exactly `tile` rows (the last tile zero-padded): the fallback when
    no row-count threshold makes the kernel invariant.
    """

    min_rows: int
    max_rows: int
    tile: int | None = None

    def apply(self, x: torch.Tensor, fn: RowFn) -> torch.Tensor:
        """fn over the rows of 2-D x, called only with row counts this rule allows."""
        m = x.shape[0]
        if self.tile is not None:
            return _tiled(x, fn, self.tile)
        if self.min_rows <= m <= self.max_rows:
            return fn(x)
        if m < self.min_rows:
            return fn(_pad_rows(x, self.min_rows))[:m]
        outs = []
        for start in range(0, m, self.max_rows):
            outs.append(self.apply(x[start:start + self.max_rows], fn))
        return torch.cat(outs)

    @classmethod
    def probe(cls, fn: RowFn, in_features: int, dtype: torch.dtype, device: torch.device,
              max_rows: int, what: str) -> RowRule:
        """Find the cheapest rule under which `fn`'s rows are invariant on this machine.

        Compares every probed row count (at two offsets into the same random
        input) against the rows of one max_rows call.
        """
        gen = torch.Generator(device="cpu").manual_seed(1234)
        x = torch.randn(max_rows + 8, in_features, generator=gen).to(dtype=dtype, device=device)
        ref = fn(x[:max_rows])
        sizes = probe_sizes(max_rows)

        def agrees(m: int, off: int) -> bool:
            return off + m > max_rows or torch.equal(fn(x[off:off + m]), ref[off:off + m])

        bad = [m for m in sizes if not (agrees(m, 0) and agrees(m, 3))]
        good_from = [c for c in _MIN_ROW_CANDIDATES if all(m < c for m in bad)]
        if good_from:
            rule = cls(min_rows=good_from[0], max_rows=max_rows)
        else:
            rule = cls._probe_tiles(fn, x, what)
        logger.info("Batch-invariant %s: rows differ at M=%s -> %s", what, bad[:12] or "none", rule)
        return rule

    @classmethod
    def _probe_tiles(cls, fn: RowFn, x: torch.Tensor, what: str) -> RowRule:
        # Fixed tiles are invariant if a row's result does not depend on where it sits in the tile.
        for tile in _TILE_CANDIDATES:
            ref = fn(x[:tile])
            if all(torch.equal(fn(x[off:off + tile])[: tile - off], ref[off:]) for off in (1, 3, tile // 2)):
                return cls(min_rows=tile, max_rows=tile, tile=tile)
        raise RuntimeError(f"--enable-deterministic-inference: no batch-invariant way to run {what} on this "
                           "machine (rows differ with their position for every tile size tried)")


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _tiled(x: torch.Tensor, fn: RowFn, tile: int) -> torch.Tensor:
    m = x.shape[0]
    padded = -(-m // tile) * tile
    if padded != m:
        x = _pad_rows(x, padded)
    return torch.cat([fn(x[s:s + tile]) for s in range(0, padded, tile)])[:m]


_RULES: dict[tuple, RowRule] = {}


def row_rule(key: tuple, fn: RowFn, in_features: int, dtype: torch.dtype, device: torch.device,
             max_rows: int, what: str) -> RowRule:
    """The cached RowRule for `key` (a description of the kernel and shape), probing it on first use."""
    full_key = (*key, dtype, device.type, torch.get_num_threads())
    rule = _RULES.get(full_key)
    if rule is None:
        rule = _RULES[full_key] = RowRule.probe(fn, in_features, dtype, device, max_rows, what)
    return rule


# Largest row count the linear probes verify: a step's token budget (the
# default --chunked-prefill-size) for the layers, fewer for big outputs such as
# the LM head, whose rows are only the sampled tokens. Larger inputs run in
# slabs of this many rows, so every call stays within the verified range.
_PROBE_FLOP_BUDGET = 2e10


def linear_probe_rows(in_features: int, out_features: int) -> int:
    """max_rows for probing an [out, in] linear: 512, halved while the probe would exceed its FLOP budget."""
    rows = 512
    while rows > 64 and 2 * in_features * out_features * 4 * rows > _PROBE_FLOP_BUDGET:
        rows //= 2
    return rows


def invariant_linear(x: torch.Tensor, fn: RowFn, kind: str, out_features: int) -> torch.Tensor:
    """fn(x) (a linear over the last dim) computed so each row is batch-invariant."""
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features)
    rule = row_rule((kind, in_features, out_features), fn, in_features, x.dtype, x.device,
                    linear_probe_rows(in_features, out_features), f"{kind} linear {in_features}->{out_features}")
    y = rule.apply(x2, fn)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, invariant: bool | None = None) -> torch.Tensor:
    """silu(gate) * up; in batch-invariant mode computed as gate / (1 + exp(-gate)) * up.

    F.silu's scalar tail loop rounds differently from its vector body, so
    which elements it hits depends on the batch size and thread split (see
    docs/measurements/batch-invariant-kernels.md); this form uses only exactly
    rounded ops and VML's exp, which is invariant per element (within 1e-6 of
    F.silu).
    """
    if not (_ENABLED if invariant is None else invariant):  # a layer passes its frozen choice
        return torch.nn.functional.silu(gate) * up
    return gate / (1 + torch.exp(-gate)) * up
