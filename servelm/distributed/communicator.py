"""The one entry point for collectives used by model code."""

from __future__ import annotations

import torch
import torch.distributed as dist

from servelm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (identity for a world of one)."""
    group = get_tp_group()
    if group.world_size == 1:
        return x
    dist.all_reduce(x, group=group.device_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `x` along `dim` in rank order."""
    group = get_tp_group()
    if group.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    dist.all_gather(parts, x.contiguous(), group=group.device_group)
    return torch.cat(parts, dim=dim)
