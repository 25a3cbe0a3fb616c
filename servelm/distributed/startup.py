"""Start-up checks of a TP group: communicator warm-up and memory balance.

Order at start-up (docs/distributed.md): all-reduce warm-up, the LM-head
all-to-all warm-up when enabled (its buffers must exist before memory is
measured), then `check_memory_balance`, whose result every rank uses to size
its KV pool so the pools are identical. `run_startup_checks` does all three.
"""

from __future__ import annotations

import logging
import socket
import time

import psutil
import torch
import torch.distributed as dist

from servelm.distributed.lm_head_all_to_all import warmup_all_to_all
from servelm.distributed.parallel_state import TPGroup, get_tp_group

logger = logging.getLogger(__name__)

UNBALANCED_RATIO = 0.9


def warmup_all_reduce(group: TPGroup | None = None) -> float:
    """One 1-element all-reduce on the TP device group (connects NCCL/gloo lazily-built links); returns seconds."""
    group = group or get_tp_group()
    if group.world_size == 1:
        return 0.0
    x = torch.ones(1, device=group.device)
    t0 = time.perf_counter()
    dist.all_reduce(x, group=group.device_group)
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    elapsed = time.perf_counter() - t0
    if x.item() != group.world_size:
        raise RuntimeError(f"TP warm-up all-reduce returned {x.item()}, expected {group.world_size}")
    logger.info("TP warm-up all-reduce (%s, %d ranks) took %.1f ms", group.backend, group.world_size,
                elapsed * 1e3)
    return elapsed


def local_rank_count(group: TPGroup | None = None) -> int:
    """How many TP ranks run on this host (hostnames all-gathered over the CPU group)."""
    group = group or get_tp_group()
    if group.world_size == 1:
        return 1
    names: list[str | None] = [None] * group.world_size
    dist.all_gather_object(names, socket.gethostname(), group=group.cpu_group)
    return names.count(socket.gethostname())


def get_local_free_memory(device: torch.device, ranks_on_host: int = 1) -> int:
    """Bytes one rank may use: free CUDA memory of `device`, or on CPU the host's available RAM
    divided by the `ranks_on_host` ranks sharing it. Not collective."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available) // max(1, ranks_on_host)


def check_memory_balance(strict: bool = False, group: TPGroup | None = None) -> int:
    """MIN all-reduce of every rank's free memory over the CPU group; returns the minimum (bytes).

    When the minimum is below 0.9 x this rank's value, logs a warning (or,
    with `strict`, raises RuntimeError): "The memory capacity is unbalanced.
    Some devices may be occupied by other processes. min=<bytes> local=<bytes>".
    """
    group = group or get_tp_group()
    if group.world_size == 1:
        return get_local_free_memory(group.device)
    # Collective on every rank, before the non-collective measurement.
    ranks_on_host = local_rank_count(group) if group.device.type == "cpu" else 1
    local = get_local_free_memory(group.device, ranks_on_host)
    t = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    minimum = int(t.item())
    if minimum < UNBALANCED_RATIO * local:
        msg = ("The memory capacity is unbalanced. Some devices may be occupied by other processes. "
               f"min={minimum} local={local}")
        if strict:
            raise RuntimeError(msg)
        logger.warning(msg)
    return minimum


def run_startup_checks(strict_memory_balance: bool = False, lm_head_all_to_all: bool = False,
                       group: TPGroup | None = None) -> int:
    """Warm up the communicators, then check memory balance; returns the memory every rank should budget."""
    group = group or get_tp_group()
    warmup_all_reduce(group)
    if lm_head_all_to_all:
        warmup_all_to_all(group)
    return check_memory_balance(strict=strict_memory_balance, group=group)
