"""Quantised weights on CPU: ggml's 32-weight block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and the matmul over them.

A `QuantWeight` is one [N out, K in] matrix quantised by rows in blocks of 32 weights, kept in the
layout the kernel reads, field by field out of the file's blocks (`FORMATS` is the registry: one row a
format): `qs` (the block payloads: int8 [N, KB, 32] for q8_0; uint8 [N, KB, 16] packed nibbles in ggml
order for q4_* and q5_*: element j in the low nibble of byte j, element j + 16 in the high one), `d` (fp16
[N, KB] block scales), `m` (fp16 [N, KB] block minimums, q4_1 and q5_1) and `qh` (int32 [N, KB], q5_*: bit j
is the fifth bit of element j). KB = ceil(K / 32); `quantize` zero-pads K to a multiple of 32.

Dequantised values are exactly gguf's (`d * q` for q8_0, `d * (q - 8)` for q4_0, `d * (q - 16)` for q5_0,
`d * q + m` for q4_1 and q5_1, fp32 mul then add). `linear` runs the C++ kernel in `csrc/` (AVX-512 with or
without VNNI / AVX2 / scalar, chosen at run time, built on first use, see `servelm.kernels.build`) or, where it
cannot be built, the torch path: dequantise, then matmul. The kernel multiplies the weights' integer codes
with x rounded per block of 32 to int16 codes on a power-of-two scale (llama.cpp's scheme with 16-bit instead
of 8-bit activations: a relative error of ~2^-15 of the block's largest |x|, ~100x below fp32 vs Q4 weight
error; see csrc/quant_common.h), exact int32 block sums, then fp32 scaling and accumulation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from servelm.kernels import build


@dataclass(frozen=True)
class BlockFormat:
    """One row of the block-format registry: a ggml 32-weight block and how the kernel reads it."""

    name: str
    ggml: GGMLQuantizationType
    code: int  # the C++ kernel's `Fmt` (csrc/quant_common.h)
    payload: int  # bytes of codes per block (qs)
    offset: int = 0  # value = d * (code - offset) (+ m)
    has_min: bool = False  # an fp16 minimum after the scale
    has_qh: bool = False  # a uint32 of fifth bits after the scales

    @property
    def header(self) -> int:
        return 2 + 2 * self.has_min + 4 * self.has_qh

    @property
    def block_bytes(self) -> int:
        return self.header + self.payload


_REGISTRY = {f.name: f for f in (
    BlockFormat("q8_0", GGMLQuantizationType.Q8_0, 0, 32),
    BlockFormat("q4_0", GGMLQuantizationType.Q4_0, 1, 16, offset=8),
    BlockFormat("q4_1", GGMLQuantizationType.Q4_1, 2, 16, has_min=True),
    BlockFormat("q5_0", GGMLQuantizationType.Q5_0, 3, 16, offset=16, has_qh=True),
    BlockFormat("q5_1", GGMLQuantizationType.Q5_1, 4, 16, has_min=True, has_qh=True),
)}
FORMATS = tuple(_REGISTRY)
BLOCK = 32
TORCH_ROWS = 4096  # weight rows dequantised at once on the torch fallback
TILES_MIN_ROWS = 10  # rows of x from which `linear` takes the fp32 tile kernel (outside deterministic mode)
FORCE_ENV = "SERVELM_QUANT_KERNEL"  # "scalar", "avx2", "avx512", "avx512_vnni" or "torch": one path (tests, benchmarks)


@dataclass
class QuantWeight:
    """One [N, K] weight quantised by rows; see the module docstring for the tensors' layout."""

    fmt: str
    shape: tuple[int, int]
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    qh: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Resident bytes of the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(qs, d, m, qh): the row-indexed fields, in one order for the row and column operations."""
        return self.qs, self.d, self.m, self.qh

    def replace(self, fn, shape: tuple[int, int]) -> QuantWeight:
        """The same format with `fn` applied to each present field."""
        qs, d, m, qh = (None if t is None else fn(t) for t in self.tensors())
        return QuantWeight(self.fmt, shape, qs, d, m, qh)

    @property
    def blocks(self) -> int:
        return self.qs.shape[1]


def block_format(fmt: str) -> BlockFormat:
    if fmt not in _REGISTRY:
        raise ValueError(f"unknown quantisation format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return _REGISTRY[fmt]


def _check_fmt(fmt: str) -> None:
    block_format(fmt)


def bytes_per_block(fmt: str) -> int:
    return block_format(fmt).block_bytes


def from_gguf(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> QuantWeight:
    """A weight from its ggml blocks: `raw` uint8 viewed [N, bytes_per_row] (GGUFReader's tensor.data).

    No fp32 round trip: the scales and payloads are copied out of the blocks as they are.
    """
    _check_fmt(fmt)
    n, k = int(shape[0]), int(shape[1])
    kb = -(-k // BLOCK)
    bpb = bytes_per_block(fmt)
    arr = np.asarray(raw).view(np.uint8).reshape(n, -1)
    if arr.shape[1] != kb * bpb:
        raise ValueError(f"{fmt} weight of shape {shape}: expected {kb * bpb} bytes per row, got {arr.shape[1]}")
    blocks = arr.reshape(n, kb, bpb)  # may be a read-only memory map: each field is copied out once

    def field(lo: int, hi: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[..., lo:hi]))

    f = block_format(fmt)
    d = field(0, 2).view(torch.float16).view(n, kb)
    m = field(2, 4).view(torch.float16).view(n, kb) if f.has_min else None
    qh = field(f.header - 4, f.header).view(torch.int32).view(n, kb) if f.has_qh else None
    qs = field(f.header, bpb)
    if fmt == "q8_0":
        qs = qs.view(torch.int8)
    return QuantWeight(fmt, (n, k), qs, d, m, qh)


# k-quant GGUF types kept as blocks the kernel reads: Q4_K repacked as q4_1 (each 32-weight sub-block's
# d * scale and dmin * min, rounded to fp16: a relative change of at most 2^-11 of those two products, the
# codes unchanged), Q6_K requantised to q8_0 (llama.cpp's Q8_0 rounding of the dequantised values: at most
# half a step of 1/127 of each 32-weight block's largest |w|).
K_FORMATS = {"q4_k": "q4_1", "q6_k": "q8_0"}
_K_ROWS = 1024  # Q6_K rows dequantised at once (bounded fp32 scratch for a big LM head)


def from_gguf_k(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> QuantWeight | None:
    """A weight from GGUF k-quant blocks (`fmt` "q4_k" or "q6_k"; see K_FORMATS): uint8 [N, bytes_per_row].

    None when a Q4_K sub-block's scale product does not fit fp16 (the caller then dequantises to fp32)."""
    if fmt not in K_FORMATS:
        raise ValueError(f"unknown k-quant format {fmt!r}; expected one of {', '.join(K_FORMATS)}")
    n, k = int(shape[0]), int(shape[1])
    arr = np.asarray(raw).view(np.uint8).reshape(n, -1)
    if fmt == "q6_k":
        parts = [quantize(torch.from_numpy(gguf_dequantize(arr[r: r + _K_ROWS], GGMLQuantizationType.Q6_K)
                                           .reshape(-1, k)), "q8_0") for r in range(0, n, _K_ROWS)]
        return parts[0] if len(parts) == 1 else cat_rows(parts)
    if k % 256 or arr.shape[1] != k // 256 * 144:
        raise ValueError(f"q4_k weight of shape {shape}: expected {k // 256 * 144} bytes per row of 256-weight "
                         f"super-blocks, got {arr.shape[1]}")
    nsb = k // 256
    blocks = arr.reshape(n * nsb, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n * nsb, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n * nsb, 8] each, 6-bit
    scale = d * sc.astype(np.float32)
    minimum = -(dmin * mins.astype(np.float32))
    if max(np.abs(scale).max(initial=0), np.abs(minimum).max(initial=0)) > np.finfo(np.float16).max:
        return None
    # Sub-block 2c holds the low nibbles of the super-block's bytes 32c..32c+31, sub-block 2c + 1 the high ones.
    qs = blocks[:, 16:].reshape(n * nsb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    vals = (qs & 0x0F).reshape(n, nsb * 8, 32)  # [n, KB, 32] codes in order
    packed = vals[..., :16] | (vals[..., 16:] << 4)  # ggml's q4 layout: element j low, j + 16 high
    return QuantWeight("q4_1", (n, k), torch.from_numpy(np.ascontiguousarray(packed)),
                       torch.from_numpy(scale.astype(np.float16).reshape(n, nsb * 8)),
                       torch.from_numpy(minimum.astype(np.float16).reshape(n, nsb * 8)))


def to_gguf(qw: QuantWeight) -> np.ndarray:
    """The ggml blocks of `qw`, uint8 [N, bytes_per_row] (inverse of `from_gguf`)."""
    n, kb = qw.shape[0], qw.blocks
    parts = [qw.d.view(torch.uint8).view(n, kb, 2)]
    if qw.m is not None:
        parts.append(qw.m.view(torch.uint8).view(n, kb, 2))
    if qw.qh is not None:
        parts.append(qw.qh.view(torch.uint8).view(n, kb, 4))
    parts.append(qw.qs.view(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(n, -1).numpy()


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """Quantise an fp32/bf16 [N, K] weight with llama.cpp's reference rounding (gguf's quantize_row_*_ref).

    K that is not a multiple of 32 is zero-padded.
    """
    _check_fmt(fmt)
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D [N, K] weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    w32 = w.detach().to(torch.float32)
    if k % BLOCK:
        w32 = F.pad(w32, (0, BLOCK - k % BLOCK))
    raw = gguf_quantize(w32.contiguous().numpy(), block_format(fmt).ggml)
    return from_gguf(raw, fmt, (n, k))


_BITS = torch.arange(32, dtype=torch.int32)


def _unpack(qw: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [n, KB * 32] of the rows `rows` (all when None), padding included."""
    qs, d, m, qh = qw.tensors()
    if rows is not None:
        qs, d, m, qh = (None if t is None else t[rows] for t in (qs, d, m, qh))
    f = block_format(qw.fmt)
    if qw.fmt == "q8_0":
        vals = qs.to(torch.float32) * d.to(torch.float32).unsqueeze(-1)
    else:
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32)
        if qh is not None:  # the fifth bits: bit j of qh is element j's
            q = q | (((qh.unsqueeze(-1) >> _BITS) & 1) << 4)
        vals = (q - f.offset).to(torch.float32) * d.to(torch.float32).unsqueeze(-1)
        if m is not None:
            vals = vals + m.to(torch.float32).unsqueeze(-1)
    return vals.reshape(*vals.shape[:-2], -1)


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """fp32 [N, K]."""
    return _unpack(qw)[:, : qw.shape[1]].contiguous()


def embedding(ids: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """The dequantised rows `qw[ids]`: fp32 [..., K]."""
    flat = ids.reshape(-1).to(torch.long)
    rows = _unpack(qw, flat)[:, : qw.shape[1]]
    return rows.reshape(*ids.shape, qw.shape[1])


_ISA_NAMES = ("scalar", "avx2", "avx512", "avx512_vnni")
_backend: str | None = None  # resolved once (see kernel_backend); force_backend() changes it


@cache
def _best_isa() -> str:
    return _ISA_NAMES[torch.ops.servelm_quant.best_isa()] if build.load_quant_ops() else "torch"


def force_backend(name: str | None) -> str:
    """Use the path `name` ("scalar", "avx2", "avx512", "avx512_vnni", "torch"; None: the best this machine has)
    from now on.

    A faster ISA than the CPU has is an error; where the kernel cannot be built every name but "torch" gives
    the torch path. Returns the path in use. The `SERVELM_QUANT_KERNEL` variable does the same at start-up.
    """
    global _backend
    forced = (name or "").strip().lower()
    if forced and forced != "torch" and forced not in _ISA_NAMES:
        raise ValueError(f"quantised-kernel path {forced!r}: expected one of torch, {', '.join(_ISA_NAMES)}")
    best = "torch" if forced == "torch" else _best_isa()
    if forced and best != "torch" and _ISA_NAMES.index(forced) > _ISA_NAMES.index(best):
        raise ValueError(f"quantised-kernel path {forced!r}: this CPU supports at most {best}")
    _backend = forced if forced and best != "torch" else best
    return _backend


def kernel_backend() -> str:
    """The path `linear` takes: "avx512_vnni", "avx512", "avx2", "scalar" (the C++ kernel) or "torch" (none here).

    The first call builds or loads the kernel (see `servelm.kernels.build`).
    """
    return _backend or force_backend(os.environ.get(FORCE_ENV))


def batch_invariant() -> bool:
    """True when `linear`'s rows do not depend on the batch (the C++ kernel; not the torch fallback)."""
    return kernel_backend() != "torch"


def linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None, *, invariant: bool = False
           ) -> torch.Tensor:
    """x @ W.T (+ bias): x fp32 [..., K] -> fp32 [..., N].

    From TILES_MIN_ROWS rows of x on, unless `invariant`, the C++ kernel takes its fp32 tile path instead
    (weights dequantised into cache-sized tiles, fp32 FMA: 2-3x faster than the int16 scheme for prefill and
    large batches, measured in docs/measurements/quant-kernels.md); its results differ from the int16
    scheme's in the last bits, so `invariant=True` (deterministic mode) keeps every M on the int16 scheme.

    With `invariant=True` (or fewer than TILES_MIN_ROWS rows) the C++ kernel is batch-invariant: each output
    element is one fixed sequence of operations on its own row of x (int16 codes per block, exact int32 block
    sums, fp32 scaling and accumulation in block order, one fixed lane-sum tree, bias last) whatever M is,
    whatever the other rows of x are and however the threads split the work, so row m is bitwise identical for
    any batch (deterministic mode relies on it). The torch fallback (`kernel_backend() == "torch"`) does not
    promise that; see `batch_invariant()`.
    """
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the weight expects {k}")
    backend = _backend or kernel_backend()
    if backend == "torch":  # dequantised a slice of rows at a time: never a whole fp32 copy of a big weight
        x32 = x.to(torch.float32)
        return torch.cat([F.linear(x32, dequantize(narrow_rows(qw, r, min(TORCH_ROWS, n - r))),
                                   None if bias is None else bias[r:r + TORCH_ROWS]) for r in range(0, n, TORCH_ROWS)],
                         dim=-1)
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.to(torch.float32)
    if k % BLOCK:
        x2 = F.pad(x2, (0, BLOCK - k % BLOCK))
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    ops = torch.ops.servelm_quant
    op = ops.linear if invariant or x2.shape[0] < TILES_MIN_ROWS else ops.linear_tiles
    y = op.default(x2, qw.qs, qw.d, qw.m, qw.qh, _REGISTRY[qw.fmt].code, bias, _ISA_NAMES.index(backend))
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def narrow_rows(qw: QuantWeight, start: int, length: int) -> QuantWeight:
    """Output rows [start, start + length) (column-parallel and vocab shards, the q/k/v split)."""
    n = qw.shape[0]
    if start < 0 or length < 0 or start + length > n:
        raise ValueError(f"narrow_rows: [{start}, {start + length}) is outside the {n} rows")
    return qw.replace(lambda t: t[start: start + length].contiguous(), (length, qw.shape[1]))


def narrow_cols(qw: QuantWeight, start: int, length: int) -> QuantWeight:
    """Input columns [start, start + length) (row-parallel TP). Whole blocks only: start and length
    must be multiples of 32 (length may also run to the end of a K that is not)."""
    k = qw.shape[1]
    if start < 0 or length < 0 or start + length > k:
        raise ValueError(f"narrow_cols: [{start}, {start + length}) is outside the {k} columns")
    if start % BLOCK or (length % BLOCK and start + length != k):
        raise ValueError(f"narrow_cols: start ({start}) and length ({length}) must be multiples of {BLOCK}, "
                         f"the {qw.fmt} block size")
    b0, nb = start // BLOCK, -(-length // BLOCK)
    return qw.replace(lambda t: t[:, b0: b0 + nb].contiguous(), (qw.shape[0], length))


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack row blocks (merged gate_up, qkv): all parts share the format and K."""
    if not parts:
        raise ValueError("cat_rows: no parts")
    fmt, k = parts[0].fmt, parts[0].shape[1]
    for p in parts:
        if p.fmt != fmt or p.shape[1] != k:
            raise ValueError(f"cat_rows: parts differ ({p.fmt}, K={p.shape[1]} vs {fmt}, K={k})")
    fields = [None if parts[0].tensors()[i] is None else torch.cat([p.tensors()[i] for p in parts])
              for i in range(4)]
    return QuantWeight(fmt, (sum(p.shape[0] for p in parts), k), *fields)


def permute_rows(qw: QuantWeight, index: torch.Tensor) -> QuantWeight:
    """Rows reordered: row i of the result is row index[i] of `qw`."""
    index = index.to(torch.long)
    if index.dim() != 1 or index.numel() != qw.shape[0]:
        raise ValueError(f"permute_rows: index must be 1-D with {qw.shape[0]} entries, got {tuple(index.shape)}")
    return qw.replace(lambda t: t.index_select(0, index), qw.shape)
