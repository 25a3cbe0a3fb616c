"""Linear layers that carry their own tensor-parallel sharding rule.

Each parameter has a `weight_loader(param, loaded, shard_id=None)` that
copies this rank's slice of a full (unsharded) HF checkpoint tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.communicator import tensor_model_parallel_all_reduce
from servelm.distributed.parallel_state import get_tp_rank, get_tp_size
from servelm.layers import batch_invariant


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a [out, in] weight, for `packed_linear`.

    NOTE: on CPU, torch's default fp32 GEMM re-packs the weight on every call;
    oneDNN with a pre-packed weight is 2-4x faster at batch 8-64 and ~2x for
    the LM head at batch 1 (this is what inductor's freezing pass emits).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PrepackMixin:
    """A linear layer whose forward switches to oneDNN once `prepack()` is called."""

    weight: torch.nn.Parameter
    packed: torch.Tensor | None = None

    def prepack(self) -> bool:
        if not can_prepack(self.weight):
            return False
        self.packed = prepack_weight(self.weight.data)
        return True

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if batch_invariant._ENABLED:
            return self._invariant_matmul(x, bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def _invariant_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same product with row counts the start-up probe found batch-invariant.

        Measured here: oneDNN (pre-packed) rows agree for every M >= 2 (M = 1
        too except for K = 1536), MKL's F.linear only from M = 12 (see
        servelm.layers.batch_invariant); so this usually just pads a one-row
        decode input to two rows, or a small batch to twelve on the eager path.
        """
        return invariant_linear_of(x, self.weight, self.packed, bias)


def invariant_linear_of(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias), oneDNN when `packed` is given, with batch-invariant rows."""
    # With a bias, aten calls addmm instead of mm: a different kernel, probed separately.
    kind = ("onednn" if packed is not None else "aten") + ("+bias" if bias is not None else "")
    if packed is not None:
        return batch_invariant.invariant_linear(x, lambda t: packed_linear(t, packed, bias), kind, weight.shape[0])
    return batch_invariant.invariant_linear(x, lambda t: F.linear(t, weight, bias), kind, weight.shape[0])


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


class ColumnParallelLinear(PrepackMixin, nn.Module):
    """y = x A^T with A split by output rows: each rank computes a slice of y."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        # Each logical output (e.g. gate and up) is sharded separately, then
        # the shards are stacked, so rank r holds [gate_r; up_r].
        self.output_sizes = [divide(s, self.tp_size, "linear output size") for s in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.output_sizes), input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard_offset(self, shard_id: int) -> tuple[int, int]:
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        offset, size = self._shard_offset(shard_id or 0)
        start = self.tp_rank * size
        param.data[offset:offset + size].copy_(loaded.narrow(0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up)."""


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are replicated when tp > num_kv_heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        tp = get_tp_size()
        self.num_heads = divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "number of key/value heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp, num_kv_heads, "tensor-parallel size over key/value heads")
        self.head_dim = head_dim
        q_total, kv_total = self.num_heads * head_dim * tp, self.num_kv_heads * head_dim * tp
        super().__init__(hidden_size, [q_total, kv_total, kv_total], bias=bias, dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        assert shard_id is not None
        offset, size = self._shard_offset(shard_id)
        # Replicated KV heads: ranks r*replicas..(r+1)*replicas-1 share head r.
        head_rank = self.tp_rank if shard_id == 0 else self.tp_rank // self.kv_replicas
        param.data[offset:offset + size].copy_(loaded.narrow(0, head_rank * size, size))


class RowParallelLinear(PrepackMixin, nn.Module):
    """y = x A^T with A split by input columns; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = divide(input_size, self.tp_size, "linear input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.bias_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        param.data.copy_(loaded.narrow(1, self.tp_rank * self.input_size, self.input_size))

    @staticmethod
    def bias_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            # Added once, after the reduction, so it is not counted tp times.
            y = y + self.bias
        return y
