"""The KV tensors: per-layer K and V storage indexed by token slot (SGLang's memory pool).

Which slot belongs to whom is decided elsewhere, in plain Python (`allocator.PageAllocator`, the prefix
cache); this module only holds the tensors.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K and V storage indexed by token slot: [layers, slots, kv_heads, head_dim].

    Slot numbers come from the PageAllocator (slot = page * page_size + offset);
    this class only stores tensors and never decides who owns a slot.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # NOTE: uninitialised on purpose (zeroing GiBs costs seconds at start-up). Attention only ever
        # reads slots a request wrote: decode padding repeats the row's own first slot, never slot 0.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
