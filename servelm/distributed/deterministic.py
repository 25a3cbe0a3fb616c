"""Deterministic all-reduce: all-gather, then an fp32 sum in rank order.

Each output element depends only on that element's values on each rank,
summed in the fixed order rank 0, 1, ..., ws-1 in fp32 and cast back once.
So the result is
* bit-identical on every rank (same bytes, same operations), and
* independent of batch size and chunking: reducing a row alone, inside any
  batch, or split over several calls gives the same bits. (A ring or tree
  all-reduce does not promise this: which order an element is summed in
  depends on where the chunk boundaries of the whole message fall.)
It does not make a sum independent of how the summands were spread over the
ranks (that is fp non-associativity, and TP fixes the spread anyway).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from servelm.distributed.parallel_state import TPGroup, get_tp_group

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def deterministic_all_reduce(x: torch.Tensor, group: TPGroup | None = None) -> torch.Tensor:
    """Sum `x` over the TP group in fp32 in rank order; returns a new tensor of x's dtype (x unchanged).

    Raises RuntimeError for dtypes other than float32, float16 and bfloat16;
    the message names the dtype as torch prints it (e.g. ``torch.int32``).
    """
    if x.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(f"deterministic all-reduce only supports float32, float16 and bfloat16, got {x.dtype}")
    group = group or get_tp_group()
    if group.world_size == 1:
        return x.clone()
    # gloo wants the output as ws input-shaped chunks along dim 0: gather flat, then view as [ws, ...]
    flat = torch.empty(group.world_size * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_single(flat, x.reshape(-1), group=group.device_group)
    gathered = flat.view(group.world_size, *x.shape)  # [ws, ...]
    acc = gathered[0].to(torch.float32)  # fp32 input: a view of our own buffer, safe to add into
    for r in range(1, group.world_size):
        acc += gathered[r]  # promotes half/bfloat16 to fp32 element by element
    return acc.to(x.dtype)
