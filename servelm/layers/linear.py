"""Linear layers that carry their own tensor-parallel sharding rule.

Each parameter has a `weight_loader(param, loaded, shard_id=None)` that
copies this rank's slice of a full (unsharded) HF checkpoint tensor, or keeps
this rank's slice of a quantised one (`QuantWeight`; see `PrepackMixin`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from servelm.config import ConfigError
from servelm.distributed.communicator import tensor_model_parallel_all_reduce
from servelm.distributed.parallel_state import get_tp_rank, get_tp_size
from servelm.kernels import quant
from servelm.kernels.quant import QuantWeight
from servelm.layers import batch_invariant
from servelm.layers.kernel_choice import KernelChoice, kernels_of

logger = logging.getLogger(__name__)


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
    """x @ W.T (+ bias) by oneDNN; `packed` from `prepack_weight`, or a plain [out, in] fp32 weight, which
    oneDNN reads where it lies (see logits.plain_onednn_linear)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PrepackMixin:
    """A linear layer that holds one copy of its weight: plain fp32 while loading, then either oneDNN's
    pre-packed copy (`prepack()`, the plain parameter is freed) or one `QuantWeight` (`finish_loading()`,
    when every shard of the weight came as quantised blocks).

    `self.weight` is None once freed; `out_features` / `in_features` say the shape.
    """

    weight: torch.nn.Parameter | None
    out_features: int
    in_features: int
    packed: torch.Tensor | None = None
    qweight: QuantWeight | None = None
    # Shards quantised in different formats (a Q4_K_M file's Q4_K q/k with a Q6_K v): runs of same-format
    # shards as one weight each, applied one after the other and their outputs concatenated.
    qweight_parts: list[QuantWeight] | None = None

    def _init_shards(self, count: int) -> None:
        self._num_shards = count
        self._quant_shards: dict[int, QuantWeight] = {}

    def prepack(self) -> bool:
        if self.weight is None or not can_prepack(self.weight):
            return False
        self.packed = prepack_weight(self.weight.data)
        self.register_parameter("weight", None)
        return True

    def finish_loading(self) -> None:
        """Every weight has arrived: quantised shards become this layer's only weight (one `qweight`, or
        `qweight_parts` where the shards' formats differ); a mix of blocks and fp32 shards is dequantised into
        the fp32 parameter instead."""
        shards, self._quant_shards = self._quant_shards, {}
        if not shards:
            return
        formats = {qw.fmt for qw in shards.values()}
        if len(shards) == self._num_shards:
            runs: list[list[QuantWeight]] = []  # consecutive shards of one format
            for i in sorted(shards):
                if runs and runs[-1][0].fmt == shards[i].fmt:
                    runs[-1].append(shards[i])
                else:
                    runs.append([shards[i]])
            parts = [run[0] if len(run) == 1 else quant.cat_rows(run) for run in runs]
            shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
            if shape != (self.out_features, self.in_features) or any(p.shape[1] != shape[1] for p in parts):
                shown = list(parts[0].shape) if len(parts) == 1 else [list(p.shape) for p in parts]
                raise ValueError(f"{type(self).__name__}: the checkpoint's quantised weight is {shown}, the model "
                                 f"expects [{self.out_features}, {self.in_features}]")  # fp32's copy_ would refuse it
            if len(parts) == 1:
                self.qweight = parts[0]
            else:
                self.qweight_parts = parts
            self.register_parameter("weight", None)
            return
        logger.info("%s: weight shards in %s and fp32 mixed; dequantised to fp32", type(self).__name__,
                    ", ".join(sorted(formats)))
        for shard_id, qw in shards.items():
            self._write_shard(shard_id, quant.dequantize(qw))

    def _write_shard(self, shard_id: int, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernels = kernels_of(self)
        if self.qweight is not None:
            return quant_linear(x, self.qweight, bias, kernels)
        if self.qweight_parts is not None:
            outs, row = [], 0
            for part in self.qweight_parts:
                n = part.shape[0]
                outs.append(quant_linear(x, part, None if bias is None else bias[row: row + n], kernels))
                row += n
            return torch.cat(outs, dim=-1)
        if kernels.deterministic:
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
        return invariant_linear_of(x, self.weight, self.packed, bias, self.out_features)


def quant_linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None,
                 kernels: KernelChoice | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) over quantised blocks, with the layer's frozen `kernels` (default: the process-wide
    switches). The C++ kernel is batch-invariant by construction (a row's result does not depend on the
    batch); its torch fallback is not, so deterministic mode pads it to a probed row count like any other
    matmul."""
    kernels = kernels or KernelChoice.from_process()
    backend = kernels.quant
    if kernels.deterministic and not quant.batch_invariant(backend):
        kind = f"quant-torch{'+bias' if bias is not None else ''}"
        return batch_invariant.invariant_linear(x, lambda t: quant.linear(t, qw, bias, backend=backend), kind,
                                                qw.shape[0])
    return quant.linear(x, qw, bias, invariant=kernels.deterministic, backend=backend)


def invariant_linear_of(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
                        bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x @ weight.T (+ bias), oneDNN when `packed` is given (then `weight` may be None), with batch-invariant
    rows."""
    # With a bias, aten calls addmm instead of mm: a different kernel, probed separately.
    kind = ("onednn" if packed is not None else "aten") + ("+bias" if bias is not None else "")
    if packed is not None:
        return batch_invariant.invariant_linear(x, lambda t: packed_linear(t, packed, bias), kind, out_features)
    return batch_invariant.invariant_linear(x, lambda t: F.linear(t, weight, bias), kind, out_features)


def block_aligned_cols(qw: QuantWeight, start: int, length: int, what: str) -> QuantWeight:
    """This rank's input columns of a row-parallel quantised weight; a clear start-up error when the split
    cuts a block of the file (32 weights; 256 for the k-quants' super-blocks)."""
    fb = quant.block_format(qw.fmt).file_block
    if start % fb or length % fb:
        raise ConfigError(f"--tp-size {get_tp_size()} splits the {qw.shape[1]} inputs of {what} into shards of "
                          f"{length}, not a multiple of the {fb}-weight {qw.fmt} block; use another "
                          "--tp-size or --quantization none")
    return quant.narrow_cols(qw, start, length)


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
        self.out_features, self.in_features = sum(self.output_sizes), input_size
        self._init_shards(len(self.output_sizes))
        self.weight = nn.Parameter(torch.empty(sum(self.output_sizes), input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard_offset(self, shard_id: int) -> tuple[int, int]:
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def _rank_start(self, shard_id: int, size: int) -> int:
        """First row of this rank's slice of logical output `shard_id` in the full checkpoint tensor."""
        return self.tp_rank * size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | QuantWeight,
                      shard_id: int | None = None) -> None:
        shard_id = shard_id or 0
        offset, size = self._shard_offset(shard_id)
        start = self._rank_start(shard_id, size)
        if isinstance(loaded, QuantWeight):
            self._quant_shards[shard_id] = quant.narrow_rows(loaded, start, size)
        else:
            param.data[offset:offset + size].copy_(loaded.narrow(0, start, size))

    def _write_shard(self, shard_id: int, tensor: torch.Tensor) -> None:
        offset, size = self._shard_offset(shard_id)
        self.weight.data[offset:offset + size].copy_(tensor)

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

    def _rank_start(self, shard_id: int, size: int) -> int:
        # Replicated KV heads: ranks r*replicas..(r+1)*replicas-1 share head r.
        head_rank = self.tp_rank if shard_id == 0 else self.tp_rank // self.kv_replicas
        return head_rank * size


class RowParallelLinear(PrepackMixin, nn.Module):
    """y = x A^T with A split by input columns; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = divide(input_size, self.tp_size, "linear input size")
        self.out_features, self.in_features = output_size, self.input_size
        self._init_shards(1)
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.bias_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | QuantWeight,
                      shard_id: int | None = None) -> None:
        start = self.tp_rank * self.input_size
        if isinstance(loaded, QuantWeight):
            cols = loaded if self.tp_size == 1 else block_aligned_cols(loaded, start, self.input_size,
                                                                       "a row-parallel linear (o_proj, down_proj)")
            self._quant_shards[0] = cols
        else:
            param.data.copy_(loaded.narrow(1, start, self.input_size))

    def _write_shard(self, shard_id: int, tensor: torch.Tensor) -> None:
        self.weight.data.copy_(tensor)

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
