"""Vocab-parallel embedding and LM head.

The vocabulary is padded to a multiple of tp and split in contiguous
blocks; the padded rows are zero and trimmed from the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.communicator import tensor_model_parallel_all_reduce
from servelm.distributed.parallel_state import get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // self.tp_size) * self.tp_size
        self.shard_size = self.padded_vocab // self.tp_size
        self.start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        end = min(self.start + self.shard_size, self.vocab_size)
        param.data.zero_()
        if end > self.start:
            param.data[: end - self.start].copy_(loaded[self.start:end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        out = out * in_shard.unsqueeze(-1).to(out.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Holds this rank's vocab block of the output projection; see LogitsProcessor."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not an embedding
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor")
