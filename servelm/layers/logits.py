"""LM head application: hidden states of the sampled rows -> full-vocab fp32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.communicator import tensor_model_parallel_all_gather
from servelm.layers import batch_invariant
from servelm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from servelm.layers.linear import can_prepack, invariant_linear_of, packed_linear, prepack_weight, quant_linear


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.packed: torch.Tensor | None = None

    def prepack(self, lm_head: VocabParallelEmbedding) -> bool:
        """Pre-pack the LM head for oneDNN. An untied head then frees its plain weight, and so does a tied
        embedding whose lookup reads blocks (`lookup_qweight`). Any other tied fp32 embedding keeps its plain
        weight for the lookup (oneDNN's blocked layout cannot be indexed by row), so that one weight is held
        twice: the price of a 1.5-2x faster LM head at batch 8+ (measured here). A quantised head is not packed."""
        if lm_head.weight is None or not can_prepack(lm_head.weight):
            return False
        self.packed = prepack_weight(lm_head.weight.data)
        if isinstance(lm_head, ParallelLMHead) or lm_head.lookup_qweight is not None:
            lm_head.register_parameter("weight", None)
        return True

    def forward(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding, gather: bool = True) -> torch.Tensor:
        """hidden: [R, hidden] -> [R, vocab] fp32 (padded vocab trimmed), or with gather=False this
        rank's vocab shard [R, V_padded/tp] (for the LM-head all-to-all)."""
        if lm_head.qweight is not None:
            logits = quant_linear(hidden, lm_head.qweight, None)
        elif batch_invariant._ENABLED:
            # The sampled rows of a step vary in number; padded to a probed invariant count.
            logits = invariant_linear_of(hidden, lm_head.weight, self.packed, None, lm_head.shard_size)
        elif self.packed is not None:
            logits = packed_linear(hidden, self.packed, None)  # [R, V/tp]
        else:
            logits = F.linear(hidden, lm_head.weight)
        if not gather:
            return logits.float()
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size].float()
