"""What one model forward needs: flat tokens of a mixed batch plus KV metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from servelm.managers.schedule_batch import StepInput
from servelm.mem_cache.memory_pool import KVCache


@dataclass
class ForwardBatch:
    """One scheduler step, flattened.

    Request i contributes tokens [extend_start[i], extend_start[i] + extend_lens[i])
    of the flat `input_ids`; its whole KV (prefix + new) is at `kv_indices[i]`.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] slot for each new token's K/V
    extend_lens: list[int]
    seq_lens: list[int]  # prefix + new tokens, per request
    kv_indices: list[torch.Tensor]  # per request, [seq_len]
    logits_indices: torch.Tensor  # [R] rows of the flat batch whose logits are needed
    kv_cache: KVCache | None = None
    # Requests that add one token (decodes, also inside a mixed prefill + decode step) share one batched
    # attention; row b of these is request decode_reqs[b], flat token decode_tokens[b]:
    decode_reqs: list[int] = field(default_factory=list)
    decode_tokens: torch.Tensor | None = None  # [B]; None when every request of the step is a decode
    decode_kv_index: torch.Tensor | None = None  # [B, Lmax] slots, padded with the row's first slot
    decode_bias: torch.Tensor | None = None  # [B, 1, 1, Lmax] fp32, 0 = attend, -inf = padding
    decode_lens: torch.Tensor | None = None  # [B] int64: row b attends to decode_kv_index[b, :decode_lens[b]]
    # Per-forward derived data that every layer shares (attention plans), keyed by what it depends on.
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    def memo(self, key: Any, build: Any) -> Any:
        """`build()` once per forward for `key`; later layers get the same object."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @property
    def is_decode(self) -> bool:
        """Every request of the step adds one token."""
        return self.decode_kv_index is not None and self.decode_tokens is None

    @classmethod
    def from_step(cls, step: StepInput, device: torch.device) -> ForwardBatch:
        """The tensors of one scheduler step."""
        return cls.build(step.input_ids, step.positions, step.out_cache_loc, step.extend_lens, step.kv_indices,
                         step.logits_indices, device)

    @classmethod
    def build(cls, input_ids: list[int], positions: list[int], out_cache_loc: list[int], extend_lens: list[int],
              kv_indices: list[list[int]], logits_indices: list[int], device: torch.device) -> ForwardBatch:
        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        seq_lens = [len(k) for k in kv_indices]
        fb = cls(input_ids=t(input_ids), positions=t(positions), out_cache_loc=t(out_cache_loc),
                 extend_lens=extend_lens, seq_lens=seq_lens, kv_indices=[t(k) for k in kv_indices],
                 logits_indices=t(logits_indices))
        fb.decode_reqs = [i for i, n in enumerate(extend_lens) if n == 1]
        if fb.decode_reqs:
            if len(fb.decode_reqs) < len(extend_lens):
                starts = [0]
                for n in extend_lens[:-1]:
                    starts.append(starts[-1] + n)
                fb.decode_tokens = t([starts[i] for i in fb.decode_reqs])
            lens = [seq_lens[i] for i in fb.decode_reqs]
            max_len = max(lens)
            index = torch.empty(len(lens), max_len, dtype=torch.long, device=device)
            for b, i in enumerate(fb.decode_reqs):
                k = fb.kv_indices[i]
                index[b, : len(k)] = k
                index[b, len(k):] = k[0]
            fb.decode_kv_index = index
            fb.decode_lens = t(lens)
            fb.decode_bias = cls.padding_bias(fb.decode_lens, max_len)
        return fb

    @staticmethod
    def padding_bias(lens: torch.Tensor, keys: int) -> torch.Tensor:
        """`decode_bias` of rows with `lens` [B] keys each, padded to `keys`: [B, 1, 1, keys] fp32, 0 or -inf."""
        pad = torch.arange(keys, device=lens.device)[None, :] >= lens[:, None]
        return torch.zeros(pad.shape, device=lens.device).masked_fill_(pad, float("-inf"))[:, None, None, :]
