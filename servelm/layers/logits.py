"""LM head application: hidden states of the sampled rows -> full-vocab fp32 logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.communicator import tensor_model_parallel_all_gather
from servelm.layers import batch_invariant
from servelm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from servelm.layers.kernel_choice import kernels_of
from servelm.layers.linear import can_prepack, invariant_linear_of, packed_linear, prepack_weight, quant_linear

# Sampled rows up to which a tied fp32 head read in place uses MKL (F.linear): about as fast as oneDNN with a
# packed weight there, while oneDNN on the plain weight is 1.2-1.5x slower at 2 rows; from 4 rows on, MKL is
# 1.4-2.7x slower than packed and oneDNN on the plain weight 1.1-1.4x (docs/measurements/tied-lm-head.md).
PLAIN_HEAD_MKL_ROWS = 2


def plain_onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T by oneDNN reading the plain [out, in] fp32 weight where it lies (its brgemm matmul takes the
    row-major layout as it is: no reorder, no copy; checked with ONEDNN_VERBOSE=1)."""
    return packed_linear(x, weight, None)


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.packed: torch.Tensor | None = None
        # A tied fp32 embedding whose one plain weight also serves the LM head (see prepack).
        self.plain_head = False

    def prepack(self, lm_head: VocabParallelEmbedding) -> bool:
        """Set the LM head up for oneDNN, its weight held once. An untied head, and a tied embedding whose lookup
        reads blocks (`lookup_qweight`), get a pre-packed copy and free the plain weight. Any other tied fp32
        embedding keeps only its plain weight, which the lookup needs (oneDNN's packed layout cannot be indexed
        by row) and the LM head reads in place: MKL up to PLAIN_HEAD_MKL_ROWS rows, oneDNN beyond. Measured
        here against a packed second copy (which would add 21-28% to the weights of SmolLM2 or Qwen2.5-0.5B):
        the head 0-12% slower at 1-2 rows, 10-40% at 3-32; a whole decode step within the noise at 1 row, up
        to ~5% slower at 2-8, ~10% at 16 (docs/measurements/tied-lm-head.md). A quantised head is not packed."""
        if lm_head.weight is None or not can_prepack(lm_head.weight):
            return False
        if not isinstance(lm_head, ParallelLMHead) and lm_head.lookup_qweight is None:
            self.plain_head = True
            return True
        self.packed = prepack_weight(lm_head.weight.data)
        lm_head.register_parameter("weight", None)
        return True

    def forward(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding, gather: bool = True) -> torch.Tensor:
        """hidden: [R, hidden] -> [R, vocab] fp32 (padded vocab trimmed), or with gather=False this
        rank's vocab shard [R, V_padded/tp] (for the LM-head all-to-all)."""
        kernels = kernels_of(self)
        if lm_head.qweight is not None:
            logits = quant_linear(hidden, lm_head.qweight, None, kernels)
        elif self.plain_head:
            logits = self._plain_head(hidden, lm_head.weight, lm_head.shard_size, kernels.deterministic)
        elif kernels.deterministic:
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

    @staticmethod
    def _plain_head(hidden: torch.Tensor, weight: torch.Tensor, out_features: int,
                    deterministic: bool) -> torch.Tensor:
        if deterministic:  # one kernel for every row count, padded to a probed invariant one
            return batch_invariant.invariant_linear(hidden, lambda t: plain_onednn_linear(t, weight), "onednn-plain",
                                                    out_features)
        if hidden.shape[0] <= PLAIN_HEAD_MKL_ROWS:
            return F.linear(hidden, weight)
        return plain_onednn_linear(hidden, weight)
