"""LM-head all-to-all (`--enable-tp-lm-head-all-to-all`).

With a vocab-parallel LM head every rank holds logits [rows, V/tp]. Instead
of all-gathering [rows, V] onto every rank, one `all_to_all_single` sends row
block j to rank j; rank j reassembles its [rows/tp, V], samples those rows,
and only the sampled token ids are gathered. Per-rank traffic drops from
rows*V to rows*V/tp values, and each rank samples rows/tp rows instead of all.

Use:
    if can_use_all_to_all(rows):
        mine = lm_head_all_to_all(local_logits)          # [rows/tp, V]
        ids = gather_sampled_tokens(sample(mine))          # [rows]
    else:
        ids = sample(tensor_model_parallel_all_gather(local_logits, -1))
Rank r owns rows `my_rows(rows)` = [r*rows/tp, (r+1)*rows/tp).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from servelm.distributed.parallel_state import TPGroup, get_tp_group

logger = logging.getLogger(__name__)

WARMUP_BYTES_PER_PEER = 4 << 20


def can_use_all_to_all(rows: int, group: TPGroup | None = None) -> bool:
    """Whether `rows` splits evenly over the TP ranks (else fall back to the all-gather path)."""
    group = group or get_tp_group()
    return rows % group.world_size == 0


def my_rows(rows: int, group: TPGroup | None = None) -> range:
    """The rows of the batch this rank receives (and samples) from `lm_head_all_to_all`."""
    group = group or get_tp_group()
    per = rows // group.world_size
    return range(group.rank * per, (group.rank + 1) * per)


def lm_head_all_to_all(local_logits: torch.Tensor, group: TPGroup | None = None) -> torch.Tensor:
    """[rows, V/tp] vocab shard of every row -> [rows/tp, V] full vocab of this rank's rows.

    Requires `can_use_all_to_all(rows)`; ValueError otherwise.
    """
    group = group or get_tp_group()
    tp = group.world_size
    if tp == 1:
        return local_logits
    rows, v_local = local_logits.shape
    if rows % tp:
        raise ValueError(f"lm_head_all_to_all needs rows divisible by tp ({rows} rows, tp={tp}); "
                         "use the all-gather path")
    # [tp, rows/tp, V/tp]: dim 0 is the destination rank, so chunk j (row block j) goes to rank j
    send = local_logits.contiguous().view(tp, rows // tp, v_local)
    recv = torch.empty_like(send)  # [tp, rows/tp, V/tp]: dim 0 is the source rank = vocab shard
    dist.all_to_all_single(recv, send, group=group.device_group)
    # [rows/tp, tp, V/tp] -> [rows/tp, V]: vocab shards side by side in rank order
    return recv.permute(1, 0, 2).reshape(rows // tp, tp * v_local)


def gather_sampled_tokens(local_token_ids: torch.Tensor, group: TPGroup | None = None) -> torch.Tensor:
    """Every rank's [rows/tp, ...] sampled values -> [rows, ...] in row order, on every rank.

    Meant for token ids, but works for any per-row tensor (e.g. logprobs) of equal shape on all ranks.
    """
    group = group or get_tp_group()
    if group.world_size == 1:
        return local_token_ids
    x = local_token_ids.contiguous()
    out = torch.empty((group.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x, group=group.device_group)
    return out


def _backend_name(pg: object) -> str:
    try:
        return str(dist.get_backend(pg))  # type: ignore[arg-type]
    except (ValueError, RuntimeError, TypeError, AttributeError):
        name = getattr(pg, "name", None)
        return str(name()) if callable(name) else type(pg).__name__


def warmup_all_to_all(group: TPGroup | None = None, bytes_per_peer: int = WARMUP_BYTES_PER_PEER) -> float:
    """One all_to_all_single of `bytes_per_peer` to every peer (run before memory is measured); returns seconds.

    Raises RuntimeError("--enable-tp-lm-head-all-to-all requires a communicator
    that supports all-to-all (got backend <name>).") when the device group
    cannot do it.
    """
    group = group or get_tp_group()
    if group.world_size == 1:
        return 0.0
    pg = group.device_group
    send = torch.zeros(group.world_size * bytes_per_peer, dtype=torch.uint8, device=group.device)
    recv = torch.empty_like(send)
    t0 = time.perf_counter()
    try:
        dist.all_to_all_single(recv, send, group=pg)
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError) as err:
        raise RuntimeError("--enable-tp-lm-head-all-to-all requires a communicator that supports "
                           f"all-to-all (got backend {_backend_name(pg)}).") from err
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    elapsed = time.perf_counter() - t0
    logger.info("LM-head all-to-all warm-up: %d MiB per peer in %.1f ms", bytes_per_peer >> 20, elapsed * 1e3)
    return elapsed
