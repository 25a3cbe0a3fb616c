"""Tensor-parallel group state: rendezvous, process groups and the all-reduce configuration.

With no process group initialised, every query answers as a world of one,
so single-process code paths need no special cases. Collectives are called
only through `servelm.distributed.communicator` (and its siblings in this
package).

Every TP group has two process groups (see docs/distributed.md, "Processes and groups"):
* `device_group`: NCCL on CUDA, gloo on CPU; carries tensors of the forward.
* `cpu_group`: always gloo; carries metadata, barriers and object broadcasts,
  so scheduling traffic never queues behind (or inside) device kernels.
"""

from __future__ import annotations

import logging
import pickle
import struct
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ALL_REDUCE_MODES = ("none", "fp", "int8", "int6", "int4")
QUICK_ALLREDUCE_WORLD_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class AllReduceConfig:
    """How `tensor_model_parallel_all_reduce` dispatches (set by `configure_all_reduce`).

    `quick_mode` is the mode actually in effect: "none" when quick all-reduce
    was requested but the world size does not support it.
    """

    mode: str = "none"
    min_bytes: int = 1 << 20
    deterministic: bool = False
    quick_mode: str = "none"


@dataclass
class TPGroup:
    """One tensor-parallel group: this process's rank in it and its two process groups."""

    rank: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    backend: str = "gloo"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    all_reduce_config: AllReduceConfig = field(default_factory=AllReduceConfig)
    # Across nodes: the address each rank talks from (by rank), so a lost peer can be named.
    peer_addresses: list[str] | None = None


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    """The current TP group (a world of one until `init_distributed`/`set_tp_group`)."""
    return _TP


def set_tp_group(group: TPGroup) -> None:
    """Install `group` as the current TP group."""
    global _TP
    _TP = group


def get_tp_rank() -> int:
    """This process's rank in the TP group."""
    return _TP.rank


def get_tp_size() -> int:
    """Number of ranks in the TP group."""
    return _TP.world_size


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port") into (host, port); ValueError when malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host, int(port)


def init_distributed(tp_size: int, tp_rank: int, dist_init_addr: str, nnodes: int = 1, node_rank: int = 0,
                     timeout_s: float = 600, backend: str | None = None, interface: str | None = None) -> TPGroup:
    """Join the TP rendezvous at tcp://`dist_init_addr` and install the resulting TP group.

    `tp_rank` is the global rank (the TP group spans all nodes); ranks are laid
    out node by node, so node `node_rank` hosts ranks
    [node_rank * tp_size/nnodes, (node_rank+1) * tp_size/nnodes). `backend`
    defaults to NCCL when CUDA is available, else gloo; the CPU group is gloo
    in every case. `timeout_s` bounds rendezvous and every collective, so a
    dead peer surfaces as an error instead of a hang. Across nodes (or with
    `interface`, --dist-interface) the ranks talk over the interface that
    `servelm.distributed.network` picks, not whatever the hostname resolves to.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"--tp-size ({tp_size}) must be a multiple of --nnodes ({nnodes})")
    per_node = tp_size // nnodes
    if tp_rank // per_node != node_rank:
        raise ValueError(f"rank {tp_rank} does not live on node {node_rank} ({per_node} ranks per node)")
    host, port = parse_dist_init_addr(dist_init_addr)
    address = None
    if nnodes > 1 or interface:
        from servelm.distributed.network import configure_tp_interface

        address = configure_tp_interface(host.strip("[]"), port, interface, tp_rank)[1]
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", tp_rank % per_node)
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, init_method=f"tcp://{host}:{port}", world_size=tp_size,
                            rank=tp_rank, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    device_group = dist.group.WORLD
    # A separate gloo group even when the device group is gloo: object
    # broadcasts then never interleave with tensor collectives of the forward.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    peers: list[str] | None = None
    if address is not None:
        peers = [""] * tp_size
        dist.all_gather_object(peers, address, group=cpu_group)
    group = TPGroup(rank=tp_rank, world_size=tp_size, device_group=device_group, cpu_group=cpu_group,
                    backend=backend, device=device, peer_addresses=peers)
    set_tp_group(group)
    logger.info("TP rank %d/%d joined tcp://%s:%d (device group %s, cpu group gloo)",
                tp_rank, tp_size, host, port, backend)
    return group


def destroy_distributed() -> None:
    """Leave the process groups (after a barrier, so no peer is mid-collective) and reset to a world of one."""
    group = get_tp_group()
    if dist.is_initialized():
        try:
            if group.cpu_group is not None:
                dist.barrier(group=group.cpu_group)
        except RuntimeError:  # a peer already left: tearing down anyway
            pass
        dist.destroy_process_group()
    set_tp_group(TPGroup())


# One broadcast carries any object whose pickle fits here; larger ones need a
# second broadcast for the rest. 4 KiB holds a typical step (a few dozen
# request ids and token counts) and costs the same as a one-float broadcast.
_BCAST_INLINE_BYTES = 4096
_HEADER = struct.Struct("<q")
_payload_bytes_sent = 0  # pickled bytes this process broadcast as the source (the step channel's measure)


def payload_bytes_sent() -> int:
    """Pickled bytes `broadcast_object` has sent from this process so far."""
    return _payload_bytes_sent


def broadcast_object(obj: Any = None, src: int = 0, group: TPGroup | None = None) -> Any:
    """Send `obj` from TP rank `src` to every rank over the CPU group; returns it on every rank.

    Non-source ranks pass anything (ignored). Cheaper than
    `dist.broadcast_object_list` for small objects: one gloo broadcast of a
    fixed 4 KiB buffer (length header + pickle) instead of two (size, then
    payload); objects that do not fit take one more broadcast for the rest.
    """
    group = group or get_tp_group()
    if group.world_size == 1:
        return obj
    buf = torch.empty(_BCAST_INLINE_BYTES, dtype=torch.uint8)
    if group.rank == src:
        global _payload_bytes_sent
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        _payload_bytes_sent += len(payload)
        head = _HEADER.pack(len(payload)) + payload[: _BCAST_INLINE_BYTES - _HEADER.size]
        buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    dist.broadcast(buf, group=group.cpu_group, group_src=src)
    (size,) = _HEADER.unpack(buf[: _HEADER.size].numpy().tobytes())
    inline = _BCAST_INLINE_BYTES - _HEADER.size
    if size <= inline:
        return obj if group.rank == src else pickle.loads(buf[_HEADER.size: _HEADER.size + size].numpy().tobytes())
    rest = torch.empty(size - inline, dtype=torch.uint8)
    if group.rank == src:
        rest.copy_(torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8))
    dist.broadcast(rest, group=group.cpu_group, group_src=src)
    if group.rank == src:
        return obj
    return pickle.loads(buf[_HEADER.size:].numpy().tobytes() + rest.numpy().tobytes())


def barrier(group: TPGroup | None = None) -> None:
    """Block until every TP rank arrives (over the CPU group)."""
    group = group or get_tp_group()
    if group.world_size > 1:
        dist.barrier(group=group.cpu_group)
