"""Tensor-parallel group state.

With no process group initialised, every query answers as a world of one,
so single-process code paths need no special cases. Collectives are called
only through `servelm.distributed.communicator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def set_tp_group(group: TPGroup) -> None:
    global _TP
    _TP = group


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.world_size
