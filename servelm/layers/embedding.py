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
from servelm.kernels import quant
from servelm.kernels.quant import QuantWeight


class VocabParallelEmbedding(nn.Module):
    """This rank's vocab block: an fp32 `weight`, or (quantised checkpoints) one `QuantWeight` whose rows are
    dequantised on lookup (`weight` is then None). Tied to the LM head, the same copy serves both; except under
    `--quantization none`, where a tied embedding that came as blocks keeps them for the lookup alone
    (`lookup_qweight`, see `keep_blocks_for_lookup`) and the LM head computes in fp32."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.padded_vocab = -(-vocab_size // self.tp_size) * self.tp_size
        self.shard_size = self.padded_vocab // self.tp_size
        self.start = self.tp_rank * self.shard_size
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=dtype),
                                                        requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.qweight: QuantWeight | None = None
        self.lookup_qweight: QuantWeight | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | QuantWeight,
                      shard_id: int | None = None) -> None:
        rows = max(min(self.start + self.shard_size, self.vocab_size) - self.start, 0)
        if isinstance(loaded, QuantWeight):
            self._load_quantized(loaded, rows)
            return
        param.data[:rows].copy_(loaded[self.start:self.start + rows])
        param.data[rows:].zero_()  # the padded vocab rows

    def _load_quantized(self, loaded: QuantWeight, rows: int) -> None:
        if loaded.shape[1] != self.hidden_size:
            raise ValueError(f"{type(self).__name__}: the checkpoint's quantised weight has {loaded.shape[1]} "
                             f"columns, the model's hidden size is {self.hidden_size}")
        part = quant.narrow_rows(loaded, self.start, rows)
        if rows < self.shard_size:  # the padded vocab rows: zero blocks
            pad = quant.quantize(torch.zeros(self.shard_size - rows, loaded.shape[1]), loaded.fmt)
            part = quant.cat_rows([part, pad])
        self.qweight = part
        self.register_parameter("weight", None)

    def keep_blocks_for_lookup(self) -> bool:
        """The blocks loaded (`qweight`) become the lookup's alone (`lookup_qweight`), and `weight` holds their
        dequantised fp32 values for the LM head, which `LogitsProcessor.prepack` packs for oneDNN, then frees.
        A lookup row dequantised from the blocks is bitwise the row of `weight`, so the model computes what it
        would from the fp32 weight alone, holding the blocks (0.14-0.27x fp32) instead of a plain fp32 copy
        next to the packed one. False (nothing done) when no blocks were loaded."""
        if self.qweight is None:
            return False
        self.lookup_qweight, self.qweight = self.qweight, None
        self.weight = nn.Parameter(quant.dequantize(self.lookup_qweight), requires_grad=False)
        return True

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        blocks = self.qweight if self.qweight is not None else self.lookup_qweight
        if blocks is not None:
            return quant.embedding(ids, blocks)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = self._lookup(local.clamp(0, self.shard_size - 1))
        out = out * in_shard.unsqueeze(-1).to(out.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Holds this rank's vocab block of the output projection; see LogitsProcessor."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not an embedding
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor")
