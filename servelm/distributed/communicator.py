"""The one entry point for collectives used by model code.

`tensor_model_parallel_all_reduce` dispatches in the order of
docs/distributed.md: world of one -> deterministic -> quick -> plain
`dist.all_reduce`. Which path ran is counted in `all_reduce_stats()` so tests
(and the bench) can prove it.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.distributed as dist

from servelm.distributed.deterministic import deterministic_all_reduce
from servelm.distributed.parallel_state import (
    ALL_REDUCE_MODES,
    QUICK_ALLREDUCE_WORLD_SIZES,
    AllReduceConfig,
    TPGroup,
    get_tp_group,
)
from servelm.distributed.quick_allreduce import quick_all_reduce

logger = logging.getLogger(__name__)

# Calls per path: "identity", "deterministic", "quick", "plain".
_PATH_COUNTS: Counter[str] = Counter()


def configure_all_reduce(mode: str = "none", min_bytes: int = 1 << 20, deterministic: bool = False,
                         group: TPGroup | None = None) -> AllReduceConfig:
    """Set how the TP group's all-reduce dispatches; returns the config now in effect.

    `mode` is the quick all-reduce mode ("none" disables it); messages of at
    least `min_bytes` take it. Quick all-reduce needs a world size of 2, 4 or
    8: any other size > 1 logs the spec's warning and keeps the plain path (a
    world of one never reduces, so it is not warned about).
    """
    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"--quick-allreduce must be one of {', '.join(ALL_REDUCE_MODES)}, got {mode!r}")
    if min_bytes < 0:
        raise ValueError(f"--quick-allreduce-min-bytes must be >= 0, got {min_bytes}")
    group = group or get_tp_group()
    quick_mode = mode
    ws = group.world_size
    if mode != "none" and ws > 1 and ws not in QUICK_ALLREDUCE_WORLD_SIZES:
        logger.warning("Quick allreduce is disabled due to an unsupported world size: %d. "
                       "Supported world sizes: %s.", ws, list(QUICK_ALLREDUCE_WORLD_SIZES))
        quick_mode = "none"
    group.all_reduce_config = AllReduceConfig(mode=mode, min_bytes=min_bytes, deterministic=deterministic,
                                       quick_mode=quick_mode)
    return group.all_reduce_config


def quick_all_reduce_eligible(x: torch.Tensor, config: AllReduceConfig) -> bool:
    """Whether `x` takes the quick path: enabled, floating point (fp32 too), at least `min_bytes`."""
    return (config.quick_mode != "none" and x.is_floating_point()
            and x.numel() * x.element_size() >= config.min_bytes)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group; ALWAYS use the return value.

    In-place contract: the plain path reduces `x` in place and returns it; the
    deterministic and quick paths return a new tensor and leave `x` unchanged;
    a world of one returns `x` itself. So callers must not rely on `x` being
    (or not being) updated, and must not hand in a tensor that aliases one they
    still need unreduced.
    """
    group = get_tp_group()
    if group.world_size == 1:
        _PATH_COUNTS["identity"] += 1
        return x
    config = group.all_reduce_config
    if config.deterministic:
        _PATH_COUNTS["deterministic"] += 1
        return deterministic_all_reduce(x, group)
    if quick_all_reduce_eligible(x, config):
        _PATH_COUNTS["quick"] += 1
        return quick_all_reduce(x, config.quick_mode, group)
    _PATH_COUNTS["plain"] += 1
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


def all_reduce_stats() -> dict[str, int]:
    """How many all-reduces took each path ("identity", "deterministic", "quick", "plain") in this process."""
    return dict(_PATH_COUNTS)


def reset_all_reduce_stats() -> None:
    """Zero the per-path counters."""
    _PATH_COUNTS.clear()
