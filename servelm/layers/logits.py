"""LM head application: hidden states of the sampled rows -> full-vocab fp32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.communicator import tensor_model_parallel_all_gather
from servelm.layers.embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding) -> torch.Tensor:
        """hidden: [R, hidden] -> [R, vocab] (padded vocab rows trimmed)."""
        logits = F.linear(hidden, lm_head.weight)  # [R, V/tp]
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size].float()
