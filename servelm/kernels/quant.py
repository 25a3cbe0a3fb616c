"""Quantised weights on CPU: ggml's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, and the k-quants Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS) kept at their own bits, and the matmul over them.

A `QuantWeight` is one [N out, K in] matrix quantised by rows, kept as 32-weight blocks in the layout the
kernel reads, field by field out of the file's blocks (`FORMATS` is the registry: one row a format):
* `qs`: the codes, int8 [N, KB, 32] for q8_0; for the others uint8 [N, KB, 16] of nibbles in ggml's q4 order
  (element j in the low nibble of byte j, element j + 16 in the high one); IQ4_NL's and IQ4_XS's nibbles index
  llama.cpp's table of 16 int8 values (`IQ4_VALUES`); Q2_K's and Q3_K's codes' two low bits as crumbs, uint8
  [N, KB, 8] in `_quad_crumbs`' layout (Q2_K's read + 4, so that the kernels compute both as 3-bit codes with
  the offset 4);
* `qh`, `qh2`: bit planes over the nibbles: the fifth bit (+16) of q5_0, q5_1, Q5_K (Q3_K: its third bit, +4,
  over the crumb, from `hmask`), int64 [N, 2 * ceil(KB / 4)], two words per quad of blocks (four blocks' k
  0..15, then their k 16..31) in the order the AVX-512 kernels' lanes come (see `_quad_planes`); Q6_K's two high
  bits (+16, +32) as 2-bit "crumbs" in `qh` alone, int64 [N, 4 * ceil(KB / 4)], 32 bytes a quad (see
  `_quad_crumbs`);
* `d`, `m`: fp16 scales and minimums, per block [N, KB] (q4_1/q5_1 have `m`), or for the k-quants per
  256-weight super-block [N, KB / 8] (`d`, and Q4_K/Q5_K's `dmin` as `m`);
* `sc`: the k-quants' two scale bytes per block [N, KB, 2]: Q4_K/Q5_K's 6-bit scale and min (unpacked from
  the 12-byte field), Q6_K's int8 scales of the block's two halves, Q3_K's the same (its 6-bit scales - 32,
  unpacked from the 12-byte field), Q2_K's its halves' bytes as in the file (4-bit scale | 4-bit minimum << 4;
  `m` holds its super-blocks' dmin); IQ4_XS's one, [N, KB, 1]: its 6-bit scale - 32 as int8 (unpacked from
  scales_l/scales_h).
On the int8 paths (AVX-512 VNNI and AVX2) a model's Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and Q8_0 matrices
are then interleaved by 16 rows (`interleave_rows16`, `rows16=True`: the same bytes, lane l of the kernel's vectors row
16g + l), which one kernel reads at every M; `rows_of` gives rows back to everything else (lookups,
dequantisation, row and column operations).
KB = ceil(K / 32); `quantize` (the 32-weight formats) zero-pads K to a multiple of 32. The k-quants take the
file's bytes (1.00x for Q6_K and Q2_K, 1.02x for IQ4_XS, 1.03x for Q4_K and Q5_K, 1.04x for Q3_K, whose 6-bit
scales are unpacked to bytes; fp32 had taken Q2_K 12.2x), Q2_K's minimum term added after the kernel
(csrc/quant_ops.cpp `split_min_for`).

Dequantised values are exactly gguf's (`d * q` for q8_0, `d * (q - 8)` for q4_0, `d * (q - 16)` for q5_0,
`d * q + m` for q4_1 and q5_1, `(d * sc) * q - dmin * mn` for Q4_K/Q5_K, `(d * sc) * (q - 32)` for Q6_K,
`(d * sc) * (q - 4)` for Q3_K, `(d * sc) * q - dmin * mn` for Q2_K,
`d * IQ4_VALUES[q]` for IQ4_NL, `(d * (sc - 32)) * IQ4_VALUES[q]` for IQ4_XS, fp32).
`linear` runs the C++ kernel in `csrc/` (AVX-512 with or without VNNI / AVX2 / scalar, chosen at run time,
built on first use, see `servelm.kernels.build`) or, where it cannot be built, the torch path: dequantise,
then matmul. The kernel multiplies the weights' integer codes with x rounded per block of 32 to integer codes:
int8 on amax / 127 with AVX-512 VNNI or AVX2 (llama.cpp's Q8_0/Q8_1 activations; the minimum term takes the
rounded block sums; the k-quants left in the row layout on AVX2 per 256 with power-of-two sub-scales,
`activation_block`), else int16
on a power-of-two scale (a relative error of ~2^-15 of the block's largest |x|;
see csrc/quant_common.h), exact int32 block sums, then fp32 scaling and accumulation.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K
from gguf.quants import quantize as gguf_quantize

from servelm.kernels import build


@dataclass(frozen=True)
class BlockFormat:
    """One row of the block-format registry: a ggml block type and how the kernel reads it as 32-weight blocks
    (csrc/quant_common.h `Traits` is the C++ side of the same row)."""

    name: str
    ggml: GGMLQuantizationType
    code: int  # the C++ kernel's `Fmt`
    payload: int  # bytes of codes per 32-weight block (qs)
    offset: int = 0  # value = scale * (code - offset) (+ min)
    has_min: bool = False  # a minimum added to each value (q4_1, q5_1; Q4_K/Q5_K: -dmin * 6-bit min)
    # bits over the nibbles: q5 1 (qh, a bit plane: +16), Q6_K 2 (+16, +32); Q3_K 1 (+4, over its crumb)
    planes: int = 0
    crumbs: bool = False  # those bits as 2-bit crumbs in qh (Q6_K, `_quad_crumbs`), not bit planes
    super_block: bool = False  # a k-quant: 256-weight super-blocks in the file, scales derived per block (sc)
    split: bool = False  # a scale per 16 weights (Q3_K, Q6_K): sc holds the int8 scales of a block's two halves
    # a minimum per 16 weights as well (Q2_K): sc's bytes hold each half's 4-bit scale (low nibble) and minimum
    # (high), as the file's do, m the super-block's dmin; the kernels compute the rest as Q3_K's (its codes + 4
    # against the offset 4) and add the minimum term after (csrc/quant_ops.cpp split_min_for)
    split_min: bool = False
    # the codes' two low bits as crumbs in qs (Q2_K, Q3_K: `_quad_crumbs`' layout, 8 bytes a block), Q3_K's third
    # bit a plane worth 4 (qh); Q2_K's codes read + 4
    crumb_codes: bool = False
    # the nibble indexes `IQ4_VALUES` (IQ4_NL, IQ4_XS); the kernels take value + 128 as an unsigned code (offset
    # 128), except AVX2's int8 micro-kernel, which takes the signed value (vpsignb)
    lut: bool = False

    @property
    def file_block(self) -> int:
        """Weights per block of the file (32, or 256 for the k-quants): TP splits fall on whole ones."""
        return 256 if self.super_block else BLOCK

    @property
    def header(self) -> int:
        """Bytes before a 32-weight format's codes: fp16 scale (+ fp16 minimum) (+ uint32 fifth bits)."""
        return 2 + 2 * self.has_min + 4 * self.planes


_REGISTRY = {f.name: f for f in (
    BlockFormat("q8_0", GGMLQuantizationType.Q8_0, 0, 32),
    BlockFormat("q4_0", GGMLQuantizationType.Q4_0, 1, 16, offset=8),
    BlockFormat("q4_1", GGMLQuantizationType.Q4_1, 2, 16, has_min=True),
    BlockFormat("q5_0", GGMLQuantizationType.Q5_0, 3, 16, offset=16, planes=1),
    BlockFormat("q5_1", GGMLQuantizationType.Q5_1, 4, 16, has_min=True, planes=1),
    BlockFormat("q4_k", GGMLQuantizationType.Q4_K, 5, 16, has_min=True, super_block=True),
    BlockFormat("q5_k", GGMLQuantizationType.Q5_K, 6, 16, has_min=True, planes=1, super_block=True),
    BlockFormat("q6_k", GGMLQuantizationType.Q6_K, 7, 16, offset=32, planes=2, crumbs=True, super_block=True,
                split=True),
    BlockFormat("iq4_nl", GGMLQuantizationType.IQ4_NL, 8, 16, offset=128, lut=True),
    BlockFormat("iq4_xs", GGMLQuantizationType.IQ4_XS, 9, 16, offset=128, super_block=True, lut=True),
    BlockFormat("q3_k", GGMLQuantizationType.Q3_K, 10, 8, offset=4, planes=1, super_block=True, split=True,
                crumb_codes=True),
    BlockFormat("q2_k", GGMLQuantizationType.Q2_K, 11, 8, offset=4, super_block=True, split=True, split_min=True,
                crumb_codes=True),
)}
FORMATS = tuple(_REGISTRY)  # every GGUF type kept at its own bits
# `quantize` writes these (gguf-py's reference rounding; it has none for the k-quants or IQ4_NL)
QUANTIZE_FORMATS = tuple(f for f, row in _REGISTRY.items() if not row.super_block and not row.lut)
# IQ4_NL's and IQ4_XS's values, llama.cpp's kvalues_iq4nl: csrc/quant_common.h kIq4Values
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
BLOCK = 32
SUPER = 256
TORCH_ROWS = 4096  # weight rows dequantised at once on the torch fallback
TILES_MIN_ROWS = 10  # int16 scheme: rows of x from which `linear` takes the fp32 tile kernel (not deterministic)
# The int8 scheme (the nibble formats on avx512_vnni_i8 / avx2_i8) keeps x's int8 codes at every row count:
# prompts too (the default model's 1,024-token text, against fp32: teacher-forced top-1 agreement 97.1% and
# perplexity +0.15% with the prompt through the panel GEMM, 97.5% and -0.09% on the micro-kernel alone;
# tests/models/test_quantized_quality.py). Many rows leave the micro-kernel for `linear_tiles`, the
# int8 panel GEMM (csrc/panels_avx512_vnni.cpp, csrc/panels_avx2.cpp), at the measured crossovers: on AVX-512
# VNNI from PANEL_MIN_ROWS (Q6_K, whose micro-kernel is the slowest: Q6K_PANEL_MIN_ROWS); on AVX2 from
# INT8_TILES_MIN_ROWS, or for the formats with bits over the nibbles (q5_*, Q5_K, Q6_K: the AVX2 micro-kernel is
# bound by adding them, 65-118 GFLOP/s against the panel's 97-155 at 12-32 rows; with Q6_K's crumbs the
# micro-kernel and the panel were even between 12 and 16 rows, Q5_K's at about 16) from PLANES_INT8_TILES_MIN_ROWS
# (docs/measurements/quant-kernels.md). The AVX2 crossovers are an AVX2-only CPU's (a Zen 3 EPYC): there the
# panel passes the micro-kernel at 10-16 rows for every format (Q4_0, Q4_1, Q4_K at the default model's and
# the 1B's shapes). An AVX-512 Zen 5 with the AVX2 path forced had put it at 96 for the formats without planes,
# its AVX2 micro-kernel being twice as fast, but avx2_i8 is the default only where there is no AVX-512.
PANEL_MIN_ROWS = 64
Q6K_PANEL_MIN_ROWS = 16
INT8_TILES_MIN_ROWS = 16
PLANES_INT8_TILES_MIN_ROWS = 12
# Q8_0 on AVX2 (both paths): its int16 panel GEMM passes the int16 micro-kernel at 12-24 rows at the 1B's shapes
# (Zen 3; docs/measurements/quant-kernels.md), where the fp32 tiles it replaces had been even with it to ~32.
Q8_PANEL_MIN_ROWS = 16
# Q8_0 on AVX-512 VNNI: its int16 panel GEMM (vpdpwssd) against the int16 micro-kernel, 2-core Zen 4: at the
# 1B's shapes 0.83-0.95x the time at 12-16 rows, 0.48-0.53x at 64-128 (280-300 GFLOP/s; the fp32 tiles it
# replaces ran at 180-187 and were slower than the micro-kernel below 32-64 rows, from 10). At K = 576 (the
# default model's LM head) the panel was behind the micro-kernel until ~32 rows (1.2x its time at 16: 18 blocks
# fill two groups of 16) and the fp32 tiles more so (1.3x at 16), so the tiles now start at 16 rows there too.
Q8_VNNI_PANEL_MIN_ROWS = 16
# ... and the panel only from K = 1,024: at K = 384 (all-MiniLM-L6-v2 in int8) and 576 (the default model)
# 16-block groups carry 25-44% padding, and the fp32 tiles ran at 0.9-1.4x the panel's speed at 256-1,024 rows
# (at K = 1,536: 0.75-0.95x), so shorter rows keep the tiles there (csrc/quant_ops.cpp q8_panel).
Q8_VNNI_PANEL_MIN_K = 1024
FORCE_ENV = "SERVELM_QUANT_KERNEL"  # one of _ISA_NAMES or "torch": one path


@dataclass
class QuantWeight:
    """One [N, K] weight quantised by rows; see the module docstring for the tensors' layout."""

    fmt: str
    shape: tuple[int, int]
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    qh: torch.Tensor | None = None
    qh2: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    # The fields interleaved by 16 rows (`interleave_rows16`): the int8 paths' layout, read at every M by
    # csrc/rows16_avx512_vnni.cpp (avx2_i8: csrc/rows16_avx2.cpp, the same bits). Everything else reads rows
    # (`rows_of` gives them back).
    rows16: bool = False

    @property
    def nbytes(self) -> int:
        """Resident bytes of the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """(qs, d, m, qh, qh2, sc): the row-indexed fields, in the order of the constructor and the kernel op."""
        return self.qs, self.d, self.m, self.qh, self.qh2, self.sc

    def replace(self, fn, shape: tuple[int, int]) -> QuantWeight:
        """The same format with `fn(field, kind)` applied to each present field: kind "block" (a column per
        32-weight block), "super" (d and m of the k-quants: one per super-block) or "plane" (qh, qh2: plane words,
        or Q6_K's crumbs, per quad of blocks)."""
        if self.rows16:
            return rows_of(self).replace(fn, shape)
        sb = block_format(self.fmt).super_block
        kinds = ("block", "super" if sb else "block", "super" if sb else "block", "plane", "plane", "block")
        fields = [None if t is None else fn(t, kind) for t, kind in zip(self.tensors(), kinds, strict=True)]
        return QuantWeight(self.fmt, shape, *fields)

    @property
    def blocks(self) -> int:
        return self.qs.shape[1]


def block_format(fmt: str) -> BlockFormat:
    if fmt not in _REGISTRY:
        raise ValueError(f"unknown quantisation format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return _REGISTRY[fmt]


def bytes_per_block(fmt: str) -> int:
    """Bytes of one block of the file (32 weights; 256 for the k-quants)."""
    return GGML_QUANT_SIZES[block_format(fmt).ggml][1]


def _words(bits: np.ndarray) -> np.ndarray:
    """[..., 32] of 0/1 -> uint32 [...]: bit j of each word is element j (packbits: no uint32 temporary per bit,
    which for a 128k-row embedding was 2 GB and 20 s)."""
    packed = np.packbits(np.ascontiguousarray(bits, dtype=np.uint8), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").reshape(bits.shape[:-1]).astype(np.uint32, copy=False)


def _quad_planes(words: np.ndarray) -> torch.Tensor:
    """Per-block plane words uint32 [N, KB] (bit k = element k) -> int64 [N, 2 * ceil(KB / 4)], two words per
    quad of blocks (4q .. 4q + 3): word 2q has bits 16e + k = block 4q + e's element k (k 0..15), word 2q + 1
    bits 16e + (k - 16) (k 16..31) (csrc/quant_common.h `plane_word`): the AVX-512 int8 kernel's low and high
    nibbles of a quad are 64 bytes in that order, so each word is one byte mask as it is; the int16 kernel's
    pair of blocks is a word's low or high half."""
    w = np.asarray(words, dtype=np.uint32).astype(np.uint64)
    if w.shape[1] % 4:
        w = np.pad(w, ((0, 0), (0, 4 - w.shape[1] % 4)))
    quads = w.reshape(w.shape[0], -1, 4)
    lo16, shifts = np.uint64(0xFFFF), np.arange(4, dtype=np.uint64) * np.uint64(16)
    lo = ((quads & lo16) << shifts).sum(-1, dtype=np.uint64)
    hi = ((quads >> np.uint64(16)) << shifts).sum(-1, dtype=np.uint64)
    out = np.stack([lo, hi], -1).reshape(w.shape[0], -1)
    return torch.from_numpy(np.ascontiguousarray(out)).view(torch.int64)


def _quad_crumbs(high: np.ndarray) -> torch.Tensor:
    """Q6_K's high bits, 0..3 [N, KB, 32] (element k of each block) -> int64 [N, 4 * ceil(KB / 4)]: 32 bytes a
    quad of blocks (csrc/quant_common.h `crumb_at`). With L the quad's low-nibble bytes in the kernels' order
    (block 4q + e's k 0..15 at 16e + k) and H its high-nibble ones (k 16..31), byte t holds the crumbs of L[t]
    (bits 0-1), L[32 + t] (2-3), H[t] (4-5) and H[32 + t] (6-7): a pair of blocks, half of a quad, shifts the
    32 bytes once and masks them."""
    n, kb = high.shape[:2]
    h = np.asarray(high, dtype=np.uint8)
    if kb % 4:
        h = np.pad(h, ((0, 0), (0, 4 - kb % 4), (0, 0)))
    q = h.reshape(n, -1, 4, 2, 16)  # [n, quad, e, k // 16, k % 16]
    lo, hi = q[:, :, :, 0].reshape(n, -1, 2, 32), q[:, :, :, 1].reshape(n, -1, 2, 32)  # [n, quad, s, t]
    out = lo[:, :, 0] | (lo[:, :, 1] << 2) | (hi[:, :, 0] << 4) | (hi[:, :, 1] << 6)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(n, -1).view(np.int64))


def _crumb_codes(crumbs: torch.Tensor, kb: int) -> torch.Tensor:
    """The inverse of `_quad_crumbs`: int32 [N, KB, 32], each element's high bits 0..3."""
    c = crumbs.contiguous().view(torch.uint8).reshape(crumbs.shape[0], -1, 1, 32).to(torch.int32)
    parts = (c >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)) & 3  # L[t], L[32+t], H[t], H[32+t]
    lo, hi = parts[:, :, :2].reshape(c.shape[0], -1, 4, 16), parts[:, :, 2:].reshape(c.shape[0], -1, 4, 16)
    return torch.cat([lo, hi], dim=-1).reshape(c.shape[0], -1, 32)[:, :kb]


def _block_words(quads: torch.Tensor, kb: int) -> np.ndarray:
    """The inverse of `_quad_planes`: uint32 [N, KB]."""
    p = quads.contiguous().numpy().view(np.uint64).reshape(quads.shape[0], -1, 2, 1)
    lo16, shifts = np.uint64(0xFFFF), np.arange(4, dtype=np.uint64) * np.uint64(16)
    lo, hi = (p[:, :, 0] >> shifts) & lo16, (p[:, :, 1] >> shifts) & lo16
    return (lo | (hi << np.uint64(16))).reshape(p.shape[0], -1)[:, :kb].astype(np.uint32)


def _nibbles(codes: np.ndarray) -> torch.Tensor:
    """[..., 32] codes 0..15 -> uint8 [..., 16] in ggml's q4 layout: element j low, j + 16 high."""
    codes = codes.astype(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(codes[..., :16] | (codes[..., 16:] << 4)))


# Rows a k-quant weight is rearranged in at a time: the temporaries stay a few times this many rows' bytes
# (a whole 128k-row embedding at once peaked at 4 GB for an 800 MB file).
_FROM_K_ROWS = 4096


def _from_k(blocks: np.ndarray, fmt: str, n: int, k: int) -> QuantWeight:
    """A weight from k-quant super-blocks `blocks` uint8 [n * nsb, bytes]: the same bits, rearranged into
    32-weight blocks (nibbles in the q4 layout, Q5_K's fifth bits as plane words per quad of blocks, Q6_K's high
    bits as crumbs, each block's two scale bytes) beside the super-blocks' fp16 d (and dmin); `_FROM_K_ROWS` rows
    at a time."""
    nsb = k // SUPER
    if n <= _FROM_K_ROWS:
        return _from_k_rows(blocks, fmt, n, k)
    out: list[torch.Tensor | None] | None = None
    for r0 in range(0, n, _FROM_K_ROWS):
        r1 = min(n, r0 + _FROM_K_ROWS)
        part = _from_k_rows(blocks[r0 * nsb: r1 * nsb], fmt, r1 - r0, k).tensors()
        if out is None:
            out = [None if t is None else t.new_empty((n, *t.shape[1:])) for t in part]
        for dst, t in zip(out, part, strict=True):
            if dst is not None:
                dst[r0:r1] = t
    assert out is not None
    return QuantWeight(fmt, (n, k), *out)


def _from_k_rows(blocks: np.ndarray, fmt: str, n: int, k: int) -> QuantWeight:
    kb, nsb = k // BLOCK, k // SUPER
    b = blocks.shape[0]

    def half(lo: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[:, lo: lo + 2])).view(torch.float16).view(n, nsb)

    if fmt == "iq4_xs":  # d, scales_h (2 bits a block), scales_l (4 bits a block), 8 blocks of 16 nibble bytes
        ib = np.arange(8)
        low = (blocks[:, 4:8][:, ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F
        high = (blocks[:, 2:4].copy().view(np.uint16) >> (2 * ib).astype(np.uint16)) & 3
        scales = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32  # [b, 8]
        sc = torch.from_numpy(np.ascontiguousarray(scales.astype(np.int8))).view(torch.uint8).view(n, kb, 1)
        qs = torch.from_numpy(np.ascontiguousarray(blocks[:, 8:136])).view(n, kb, 16)
        return QuantWeight(fmt, (n, k), qs, half(0), None, None, None, sc)
    if fmt in ("q4_k", "q5_k"):
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [b, 8] each, 6-bit
        scales = torch.from_numpy(np.ascontiguousarray(np.stack([sc, mins], -1).astype(np.uint8))).view(n, kb, 2)
        qs_off = 16 if fmt == "q4_k" else 48
        # Sub-block 2c holds the low nibbles of bytes 32c..32c+31 of qs, sub-block 2c + 1 the high ones.
        low = (blocks[:, qs_off: qs_off + 128].reshape(b, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1))
        codes = (low & 0x0F).reshape(n, kb, 32)
        qh = None
        if fmt == "q5_k":  # bit s of byte l of qh: the fifth bit of element l of sub-block s
            raw = blocks[:, 16:48].reshape(b, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            qh = _quad_planes(_words((raw & 1).reshape(n, kb, 32)))
        return QuantWeight(fmt, (n, k), _nibbles(codes), half(0), half(2), qh, None, scales)
    if fmt == "q2_k":  # scales [16] (4-bit scale | 4-bit min << 4, one per 16 weights), qs [64], fp16 d, dmin
        # element 32 j + l (block j, l 0..31): two bits at bit 2 (j % 4) of qs byte 32 (j // 4) + l, as Q3_K's
        # low bits; value d * sc * q - dmin * mn. The codes as crumbs (Q6_K's high bits' layout), which the
        # kernels read + 4 and compute as Q3_K's (d * sc) * (code - 4); the scale bytes as they are, whose high
        # nibbles (the minimums) the kernels' minimum term reads.
        low = blocks[:, 16:80].reshape(b, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        codes = (low.reshape(b, 8, 32) & 3).reshape(n, kb, 32)
        sc = torch.from_numpy(np.ascontiguousarray(blocks[:, :16])).view(n, kb, 2)  # scale | min << 4, as the file
        qs = _quad_crumbs(codes).view(torch.uint8).view(n, kb, 8)
        return QuantWeight(fmt, (n, k), qs, half(80), half(82), None, None, sc)
    if fmt == "q3_k":  # hmask [32], qs [64], 12 bytes of 6-bit scales, fp16 d (gguf.quants.Q3_K's order)
        # element 32 j + l of a super-block (block j, l 0..31): two low bits at bit 2 (j % 4) of qs byte
        # 32 (j // 4) + l, the third at bit j of hmask byte l; code = their 3 bits, value d * (sc - 32) * (code - 4)
        low = blocks[:, 32:96].reshape(b, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        high = blocks[:, :32].reshape(b, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        crumbs = (low.reshape(b, 8, 32) & 3).reshape(n, kb, 32)
        qh = _quad_planes(_words((high & 1).reshape(n, kb, 32)))  # the third bit, worth 4
        lsc = (blocks[:, 96:104].reshape(b, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(b, 16)
        hsc = (blocks[:, 104:108].reshape(b, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(b, 16)
        scales = ((lsc & 15) | ((hsc & 3) << 4)).astype(np.int16) - 32  # one per 16 weights: block j's 2j, 2j + 1
        sc = torch.from_numpy(np.ascontiguousarray(scales.astype(np.int8))).view(torch.uint8).view(n, kb, 2)
        return QuantWeight(fmt, (n, k), _quad_crumbs(crumbs).view(torch.uint8).view(n, kb, 8), half(108), None, qh,
                           None, sc)
    # Q6_K: ql [128], qh [64], int8 scales [16] (one per 16 weights), fp16 d; per half h (128 weights) ql's
    # 64 bytes hold elements 0..63 (low nibbles) and 64..127 (high), qh's 32 bytes four 2-bit fields per byte.
    low = blocks[:, :128].reshape(b, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (low & 0x0F).reshape(n, kb, 32)
    high = (blocks[:, 128:192].reshape(b, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    high = high.reshape(n, kb, 32)
    scales = torch.from_numpy(np.ascontiguousarray(blocks[:, 192:208])).view(n, kb, 2)
    return QuantWeight(fmt, (n, k), _nibbles(codes), half(208), None, _quad_crumbs(high), None, scales)


def from_gguf(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> QuantWeight:
    """A weight from its ggml blocks: `raw` uint8 viewed [N, bytes_per_row] (GGUFReader's tensor.data).

    No fp32 round trip: the scales and codes are copied out of the blocks as they are (the k-quants' bits
    rearranged into 32-weight blocks, see `_from_k`).
    """
    row = block_format(fmt)
    n, k = int(shape[0]), int(shape[1])
    arr = np.asarray(raw).view(np.uint8).reshape(n, -1)
    fb = row.file_block
    if row.super_block and k % fb:
        raise ValueError(f"{fmt} weight of shape {shape}: K must be a multiple of its {fb}-weight super-blocks")
    nblk = -(-k // fb)
    bpb = bytes_per_block(fmt)
    if arr.shape[1] != nblk * bpb:
        raise ValueError(f"{fmt} weight of shape {shape}: expected {nblk * bpb} bytes per row, got {arr.shape[1]}")
    if row.super_block:
        return _from_k(arr.reshape(n * nblk, bpb), fmt, n, k)
    kb = nblk
    blocks = arr.reshape(n, kb, bpb)  # may be a read-only memory map: each field is copied out once

    def field(lo: int, hi: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(blocks[..., lo:hi]))

    d = field(0, 2).view(torch.float16).view(n, kb)
    m = field(2, 4).view(torch.float16).view(n, kb) if row.has_min else None
    qh = _quad_planes(blocks[..., row.header - 4: row.header].copy().view(np.uint32).reshape(n, kb)) \
        if row.planes else None
    qs = field(row.header, bpb)
    if fmt == "q8_0":
        qs = qs.view(torch.int8)
    return QuantWeight(fmt, (n, k), qs, d, m, qh)


# The formats with a 16-row layout (csrc/quant_common.h R16W).
ROWS16_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q8_0")


def rows16_eligible(qw: QuantWeight) -> bool:
    """Whether `interleave_rows16` takes this weight: a format of ROWS16_FORMATS, whole groups of 16 rows."""
    return not qw.rows16 and qw.fmt in ROWS16_FORMATS and qw.shape[0] % 16 == 0 and qw.shape[0] > 0


def interleave_rows16(qw: QuantWeight) -> QuantWeight:
    """The same bytes reordered so that lane l of the kernel's vectors is row 16g + l (csrc/quant_common.h R16W):
    per group of 16 rows and block, the codes of the 16 rows four bytes at a time (Q8_0: two codes at a time),
    their scales side by side, Q6_K's high bits two crumbs a chunk, the q5s' fifth bits two a chunk.

    Why: the row layout's decode kernel spends a convert, a multiply and an fma per 128 weights and (weight row,
    x row), and decodes each block again per 3 rows of x; this layout spends them once per 512 weights and row
    of x and decodes a block once for up to 6 rows, so a speculative verify step's 5 rows and a prompt's many
    rows run one kernel (docs/measurements/quant-kernels.md, "Twenty-third session")."""
    if not rows16_eligible(qw):
        raise ValueError(f"interleave_rows16: {qw.fmt} [{qw.shape[0]}, {qw.shape[1]}] has no 16-row layout")
    n, kb = qw.shape[0], qw.blocks
    g = n // 16

    def by_group(t: torch.Tensor) -> torch.Tensor:  # [N, X] -> [G, X, 16]
        return t.reshape(g, 16, -1).permute(0, 2, 1).contiguous()

    # the codes moved in their units (4 bytes; Q8_0's pairs 2): a strided copy of bytes was 4x the elements
    unit, width = (torch.int16, 2) if qw.fmt == "q8_0" else (torch.int32, 4)
    units = qw.qs.contiguous().view(torch.uint8).reshape(n, kb, -1, width).view(unit).squeeze(-1)  # [N, KB, chunks]
    qs = units.reshape(g, 16, kb, -1).permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [G, KB, chunks, 16 * width]
    qs = qs.reshape(g, kb, -1, 16, width).view(qw.qs.dtype)
    sc = qw.sc.reshape(g, 16, kb, 2).permute(0, 2, 3, 1).contiguous() if qw.sc is not None else None
    hb = None
    if qw.fmt == "q6_k":  # element 8p + 4u + c (low nibbles) and 16 + 8p + 4u + c (high): byte (p, row, c)
        high = _crumb_codes(qw.qh, kb).to(torch.uint8).reshape(g, 16, kb, 2, 2, 2, 4)  # [.., half, p, u, c]
        lo, hi = high[:, :, :, 0], high[:, :, :, 1]  # [g, 16, kb, p, u, c]
        packed = lo[..., 0, :] | (hi[..., 0, :] << 2) | (lo[..., 1, :] << 4) | (hi[..., 1, :] << 6)
        hb = packed.permute(0, 2, 3, 1, 4).contiguous()  # [G, KB, 2, 16, 4]
    elif qw.qh is not None:  # the fifth bits: element 4j + c's at bit 2j of byte (row, c), 16 + 4j + c's at 2j + 1
        words = torch.from_numpy(_block_words(qw.qh, kb).astype(np.int64)).reshape(g, 16, kb, 1, 1)
        j, c = torch.arange(4).view(4, 1), torch.arange(4).view(1, 4)
        lo, hi = (words >> (4 * j + c)) & 1, (words >> (16 + 4 * j + c)) & 1  # [g, 16, kb, j, c]
        packed = ((lo << (2 * j)) | (hi << (2 * j + 1))).sum(dim=3).to(torch.uint8)  # [g, 16, kb, c]
        hb = packed.permute(0, 2, 1, 3).contiguous()  # [G, KB, 16, 4]
    return QuantWeight(qw.fmt, qw.shape, qs, by_group(qw.d), None if qw.m is None else by_group(qw.m), hb, None,
                       sc, rows16=True)


_ROWS16_CHUNK = 4096  # weight rows interleaved at a time at load (a multiple of 16)
ROWS16_ENV = "SERVELM_ROWS16"  # "0": keep the row layout on the int8 paths too (A/B measurements)
ROWS16_PATHS = ("avx512_vnni_i8", "avx2_i8")  # the kernel paths with a 16-row kernel


def rows16_default(backend: str | None = None) -> bool:
    """Whether a model's weights take the 16-row layout: on the int8 paths (AVX-512 VNNI, AVX2), unless
    SERVELM_ROWS16=0."""
    return (backend or kernel_backend()) in ROWS16_PATHS and os.environ.get(ROWS16_ENV, "1") != "0"


def interleave_in_place(weights: list[QuantWeight]) -> int:
    """`interleave_rows16` applied to each eligible weight of `weights` in place (the modules keep their
    objects), their fields written one after another (in the order given: a model's execution order) into one
    buffer advised for transparent huge pages, as `pack_weights` does for the others; returns how many were.
    Each weight's row copy goes as its interleaved one is written, so the process holds one model's bytes and
    one weight's more (the buffer's pages are touched as they are written)."""
    todo: list[QuantWeight] = []
    seen: set[int] = set()
    for qw in weights:
        if id(qw) not in seen and rows16_eligible(qw):
            seen.add(id(qw))
            todo.append(qw)
    # the row fields' bytes bound the interleaved ones' (equal, but the q5s' plane words pad KB to whole quads)
    total = sum(_aligned(t) for qw in todo for t in qw.tensors() if t is not None)
    if total == 0:
        return 0
    buf, at = _huge_buffer(total)
    for qw in todo:
        # _ROWS16_CHUNK rows at a time: the fields are group-major, so a chunk's groups are a slice of each; the
        # temporaries stay small (Q6_K's high bits unpack to 128 bytes a weight row and block: 1 GB for a 128k
        # vocabulary at once)
        out: dict[str, torch.Tensor] = {}
        for r0 in range(0, qw.shape[0], _ROWS16_CHUNK):
            rows = min(_ROWS16_CHUNK, qw.shape[0] - r0)
            part = interleave_rows16(qw if rows == qw.shape[0] else narrow_rows(qw, r0, rows))
            for f in _FIELDS:
                t = getattr(part, f)
                if t is None:
                    continue
                if f not in out:  # the whole field's place in the buffer: G groups where the part has its own
                    shape = (qw.shape[0] // 16, *t.shape[1:])
                    nbytes = t.element_size() * math.prod(shape)
                    out[f] = buf[at: at + nbytes].view(t.dtype).view(shape)
                    at += -(-nbytes // 64) * 64
                out[f][r0 // 16: (r0 + rows) // 16] = t
        for f in _FIELDS:
            setattr(qw, f, out.get(f))
        qw.rows16 = True
    _libc("malloc_trim", ctypes.c_size_t(0))  # the row copies were malloc'd: give their pages back
    return len(todo)


def _aligned(t: torch.Tensor) -> int:
    """A field's bytes in a packed buffer: 64-byte aligned."""
    return -(-t.numel() * t.element_size() // 64) * 64


def _huge_buffer(total: int) -> tuple[torch.Tensor, int]:
    """An uninitialised byte buffer with `total` bytes from a huge-page boundary (its offset) on, advised for
    transparent huge pages."""
    buf = torch.empty(total + _HUGE, dtype=torch.uint8)
    at = -buf.data_ptr() % _HUGE  # huge-page aligned
    _libc("madvise", ctypes.c_void_p(buf.data_ptr() + at), ctypes.c_size_t(total), 14, linux_only=True)  # MADV_HUGEPAGE
    return buf, at


def rows_of(qw: QuantWeight, rows: torch.Tensor | None = None) -> QuantWeight:
    """The rows `rows` (all when None) of a weight in the row layout: `interleave_rows16` undone."""
    if not qw.rows16:
        return qw if rows is None else qw.replace(lambda t, _: t[rows], (int(rows.numel()), qw.shape[1]))
    n, kb = qw.shape[0], qw.blocks
    idx = torch.arange(n) if rows is None else rows.reshape(-1).to(torch.long)
    g, lane = idx // 16, idx % 16
    qs = qw.qs[g, :, :, lane, :].reshape(len(idx), kb, -1)

    def rows_from(t: torch.Tensor) -> torch.Tensor:  # [G, X, 16] -> [n, X]
        return t[g, :, lane]

    sc = qw.sc[g, :, :, lane] if qw.sc is not None else None
    qh = None
    if qw.fmt == "q6_k":
        b = qw.qh[g, :, :, lane, :].to(torch.int32)  # [n, KB, p, c]
        lo = torch.stack([b & 3, (b >> 4) & 3], dim=-2)  # [n, KB, p, u, c]
        hi = torch.stack([(b >> 2) & 3, (b >> 6) & 3], dim=-2)
        high = torch.stack([lo, hi], dim=2).reshape(len(idx), kb, 32)  # [n, KB, half, p, u, c]
        qh = _quad_crumbs(high.numpy().astype(np.uint8))
    elif qw.qh is not None:
        b = qw.qh[g, :, lane, :].to(torch.int64).unsqueeze(-2)  # [n, KB, 1 (j), c]
        j, c = torch.arange(4).view(4, 1), torch.arange(4).view(1, 4)
        bits = (((b >> (2 * j)) & 1) << (4 * j + c)) | (((b >> (2 * j + 1)) & 1) << (16 + 4 * j + c))
        qh = _quad_planes(bits.sum(dim=(-2, -1)).numpy().astype(np.uint32))
    return QuantWeight(qw.fmt, (len(idx), qw.shape[1]), qs.contiguous(), rows_from(qw.d).contiguous(),
                       None if qw.m is None else rows_from(qw.m).contiguous(), qh, None,
                       None if sc is None else sc.contiguous())


_FIELDS = ("qs", "d", "m", "qh", "qh2", "sc")
_HUGE = 2 << 20  # a transparent huge page
# Fields of at least this size stay where they are: numpy advises huge pages for arrays from 4 MB on, and
# packing the Llama-3.2-1B shape's (all of its 813 MB) gained nothing measurable and took 1.75 s of its start-up.
_PACK_BELOW = 4 << 20


def pack_weights(weights: list[QuantWeight]) -> int:
    """Move the fields under 4 MB of `weights` (each weight once, in the order given: a model's execution order)
    into one buffer advised for transparent huge pages; returns its bytes.

    Why: a small model's matrices are many tensors under numpy's 4 MB huge-page threshold, so its decode step
    reads ~100 MB through 4 KB pages, a TLB miss every 4 KB of a stream, which a VM's nested page walk makes
    dear. The default model's 30 decode layers read from memory, against the same fields in tensors of their own,
    interleaved in one process: 0.947x and 0.945x the time in two runs (docs/measurements/quant-kernels.md,
    eighth session). The bits of every field are copied as they are; the RSS after loading is unchanged."""
    seen: set[int] = set()
    fields: list[tuple[QuantWeight, str, torch.Tensor, int]] = []  # (weight, field, tensor, its aligned bytes)
    for qw in weights:
        if id(qw) in seen or qw.rows16:  # interleave_in_place packed those already
            continue
        seen.add(id(qw))
        for f in _FIELDS:
            t = getattr(qw, f)
            if t is not None and t.numel() * t.element_size() < _PACK_BELOW:
                fields.append((qw, f, t, _aligned(t)))
    total = sum(size for *_, size in fields)
    if total == 0:
        return 0
    buf, at = _huge_buffer(total)
    for qw, f, t, size in fields:
        dst = buf[at: at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        dst.copy_(t)
        setattr(qw, f, dst)
        at += size
    _libc("malloc_trim", ctypes.c_size_t(0))  # the old copies were malloc'd: give their pages back
    return total


def _libc(name: str, *args: object, linux_only: bool = False) -> None:
    """Call C library function `name` where this platform's C library has it (madvise, glibc's malloc_trim);
    elsewhere nothing: both only help."""
    if linux_only and not sys.platform.startswith("linux"):
        return
    try:
        getattr(ctypes.CDLL(None), name)(*args)
    except (OSError, AttributeError):
        pass


def to_gguf(qw: QuantWeight) -> np.ndarray:
    """The ggml blocks of `qw`, uint8 [N, bytes_per_row] (inverse of `from_gguf`; the 32-weight formats)."""
    qw = rows_of(qw)
    if block_format(qw.fmt).super_block:
        raise ValueError(f"to_gguf: {qw.fmt} is kept rearranged into 32-weight blocks; only the 32-weight formats "
                         "are written back")
    n, kb = qw.shape[0], qw.blocks
    parts = [qw.d.view(torch.uint8).view(n, kb, 2)]
    if qw.m is not None:
        parts.append(qw.m.view(torch.uint8).view(n, kb, 2))
    if qw.qh is not None:
        words = torch.from_numpy(np.ascontiguousarray(_block_words(qw.qh, kb))).view(torch.uint8)
        parts.append(words.view(n, kb, 4))
    parts.append(qw.qs.view(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(n, -1).numpy()


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """Quantise an fp32/bf16 [N, K] weight with llama.cpp's reference rounding (gguf's quantize_row_*_ref).

    K that is not a multiple of 32 is zero-padded. The k-quants are read from files, never written here (gguf-py
    cannot quantise them).
    """
    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"quantize: {fmt!r} is not one of {', '.join(QUANTIZE_FORMATS)}")
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
    """fp32 [n, KB * 32] of the rows `rows` (all when None), padding included: exactly gguf's values."""
    if qw.rows16:
        qw, rows = rows_of(qw, rows), None
    fields = qw.tensors() if rows is None else tuple(None if t is None else t[rows] for t in qw.tensors())
    qs, d, m, qh, qh2, sc = fields
    f = block_format(qw.fmt)
    if qw.fmt == "q8_0":
        q = qs.to(torch.int32)
    elif f.crumb_codes:  # Q2_K, Q3_K: 2-bit crumbs (Q2_K's read + 4, the offset; Q3_K's third bit a plane below)
        q = _crumb_codes(qs.reshape(qs.shape[0], -1).view(torch.int64), qw.blocks) + (0 if f.planes else f.offset)
    elif f.lut:  # the table's values: the offset is already out
        q = torch.tensor(IQ4_VALUES, dtype=torch.int32)[torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()] + f.offset
    else:
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32)
        if f.crumbs:  # the two high bits together
            q = q | (_crumb_codes(qh, qw.blocks) << 4)
            qh = None
    for shift, plane in (((2 if f.crumb_codes else 4), qh), (5, qh2)):  # Q3_K's third bit: 4; the q5s' fifth: 16
        if plane is not None:  # per-block words: bit j is element j's
            words = torch.from_numpy(_block_words(plane, qw.blocks).astype(np.int64))
            q = q | (((words.unsqueeze(-1) >> _BITS) & 1) << shift).to(torch.int32)
    q = (q - f.offset).to(torch.float32)  # [..., KB, 32]
    if not f.super_block:
        vals = q * d.to(torch.float32).unsqueeze(-1)
        return (vals + m.to(torch.float32).unsqueeze(-1) if m is not None else vals).flatten(-2)
    per_block = (d.to(torch.float32).repeat_interleave(SUPER // BLOCK, dim=-1)).unsqueeze(-1)  # [..., KB, 1]
    if qw.fmt == "iq4_xs":  # d * (6-bit scale - 32), exact in fp32
        return (q * per_block * sc.view(torch.int8).to(torch.float32)).flatten(-2)
    if f.split and not f.split_min:  # Q3_K, Q6_K: an int8 scale per 16 weights: d * scale, exact in fp32
        scale = per_block * sc.view(torch.int8).to(torch.float32).repeat_interleave(16, dim=-1)
        return (q * scale).flatten(-2)
    if f.split_min:  # Q2_K: d * its 4-bit scale minus dmin * its 4-bit minimum per 16 weights, one rounding
        scale = per_block * (sc & 15).to(torch.float32).repeat_interleave(16, dim=-1)
        dmin = m.to(torch.float32).repeat_interleave(SUPER // BLOCK, dim=-1).unsqueeze(-1)
        return (q * scale - dmin * (sc >> 4).to(torch.float32).repeat_interleave(16, dim=-1)).flatten(-2)
    dmin = m.to(torch.float32).repeat_interleave(SUPER // BLOCK, dim=-1).unsqueeze(-1)
    scale, minimum = per_block * sc[..., :1].to(torch.float32), dmin * sc[..., 1:].to(torch.float32)
    return (q * scale - minimum).flatten(-2)


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """fp32 [N, K]."""
    return _unpack(qw)[:, : qw.shape[1]].contiguous()


def embedding(ids: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """The dequantised rows `qw[ids]`: fp32 [..., K]."""
    flat = ids.reshape(-1).to(torch.long)
    rows = _unpack(qw, flat)[:, : qw.shape[1]]
    return rows.reshape(*ids.shape, qw.shape[1])


# "avx512_vnni_i8" and "avx2_i8" are AVX-512 VNNI and AVX2 with int8 activations for the nibble formats
# (`activation_scheme`), the default on those CPUs: x rounded per block of 32 as llama.cpp's q8_0 / q8_1
# activations, vpdpbusd over four blocks a step (vpmaddubsw + vpmaddwd over two on AVX2). On the default model
# it scores perplexity -0.09% and teacher-forced top-1 agreement 97.5% against fp32 (the int16 scheme, still
# "avx512_vnni" / "avx2": -0.01%, 100%), for a decode kernel 1.6-1.8x faster with VNNI and 1.2-1.9x on AVX2
# (docs/measurements/quant-kernels.md). Q8_0 weights keep the int16 scheme (bandwidth-bound there).
_ISA_NAMES = ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_vnni_i8", "avx2_i8")  # the C++ kernel's indices
_RUNS_ON = {"avx512_vnni_i8": "avx512_vnni", "avx2_i8": "avx2"}  # the int8 variants' ISAs
_INT8_DEFAULT = {"avx512_vnni": "avx512_vnni_i8", "avx2": "avx2_i8"}  # the default path on each ISA
_LEVELS = ("scalar", "avx2", "avx512", "avx512_vnni")
_backend: str | None = None  # resolved once (see kernel_backend); force_backend() changes it


@cache
def _best_isa() -> str:
    return _ISA_NAMES[torch.ops.servelm_quant.best_isa()] if build.load_quant_ops() else "torch"


def force_backend(name: str | None) -> str:
    """Use the path `name` ("scalar", "avx2", "avx512", "avx512_vnni" (int16 activations), "avx2_i8",
    "avx512_vnni_i8" (int8), "torch"; None: the best this machine has) from now on.

    A faster ISA than the CPU has is an error; where the kernel cannot be built every name but "torch" gives
    the torch path. Returns the path in use. The `SERVELM_QUANT_KERNEL` variable does the same at start-up.
    """
    global _backend
    forced = (name or "").strip().lower()
    if forced and forced != "torch" and forced not in _ISA_NAMES:
        raise ValueError(f"quantised-kernel path {forced!r}: expected one of torch, {', '.join(_ISA_NAMES)}")
    best = "torch" if forced == "torch" else _best_isa()
    if forced and best != "torch" and not _runs_on(forced, best):
        raise ValueError(f"quantised-kernel path {forced!r}: this CPU supports at most {best}")
    _backend = forced if forced and best != "torch" else _INT8_DEFAULT.get(best, best)
    return _backend


AMX_ENV = "SERVELM_QUANT_AMX"  # "0": no AMX tiles; "1": AMX tiles (an error where the CPU has none)
_amx_env_done = False


def set_amx(enabled: bool | None) -> bool:
    """Whether the 16-row kernel takes AMX tiles for 12+ rows of x (prompts, large batches; Intel Sapphire Rapids
    and later, `csrc/rows16_amx.cpp`): True on (an error where there are no AMX tiles), False off, None the
    default (on where there are). Its outputs are the AVX-512 VNNI kernel's bits either way. Returns whether it
    is on. `SERVELM_QUANT_AMX` (0 or 1) does the same at start-up."""
    if not build.load_quant_ops():
        if enabled:
            raise ValueError("AMX tiles: the quantised-weight kernels are not built here")
        return False
    try:
        return bool(torch.ops.servelm_quant.set_amx(-1 if enabled is None else int(bool(enabled))))
    except RuntimeError as e:
        raise ValueError(f"AMX tiles: {str(e).splitlines()[0]}") from None


def amx_in_use() -> bool:
    """Whether the 16-row kernel takes AMX tiles for 12+ rows of x now (`set_amx`)."""
    return build.load_quant_ops() and bool(torch.ops.servelm_quant.amx_on())


def _apply_amx_env() -> None:
    global _amx_env_done
    if _amx_env_done:
        return
    value = os.environ.get(AMX_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{AMX_ENV}={value!r}: expected 0 or 1")
    if value:
        set_amx(value == "1")
    _amx_env_done = True


def _runs_on(name: str, best: str) -> bool:
    """Whether kernel path `name` runs on a CPU whose best ISA is `best` (not "torch")."""
    return _LEVELS.index(_RUNS_ON.get(name, name)) <= _LEVELS.index(best)


def available_backends() -> list[str]:
    """Every path `force_backend` accepts on this CPU ("torch" always)."""
    best = _best_isa()
    if best == "torch":
        return ["torch"]
    return [n for n in _ISA_NAMES if _runs_on(n, best)] + ["torch"]


def kernel_backend() -> str:
    """The path `linear` takes: "avx512_vnni_i8", "avx512_vnni", "avx512", "avx2_i8", "avx2", "scalar" (the C++
    kernel) or "torch" (none here).

    The first call builds or loads the kernel (see `servelm.kernels.build`).
    """
    if _backend:
        return _backend
    _apply_amx_env()
    return force_backend(os.environ.get(FORCE_ENV))


@cache
def tiles_min_rows(fmt: str, backend: str) -> int:
    """Rows of x from which `linear` (outside deterministic mode) and `fused.decode_layer` leave the integer
    micro-kernel for `linear_tiles`, the many-rows path: on the int8 paths the int8 panel GEMM for the nibble
    formats, for Q8_0 on AVX2 and AVX-512 VNNI the panel GEMM with int16 codes, elsewhere the fp32 tiles
    (`many_rows_scheme`).
    `backend`: a kernel path."""
    scheme = many_rows_scheme(fmt, backend)
    if scheme == "int16":  # Q8_0's int16 panel against the int16 micro-kernel
        return Q8_VNNI_PANEL_MIN_ROWS if backend.startswith("avx512") else Q8_PANEL_MIN_ROWS
    if scheme == "fp32":
        return TILES_MIN_ROWS
    if backend == "avx512_vnni_i8":
        return Q6K_PANEL_MIN_ROWS if fmt == "q6_k" else PANEL_MIN_ROWS
    return PLANES_INT8_TILES_MIN_ROWS if block_format(fmt).planes else INT8_TILES_MIN_ROWS


def many_rows_scheme(fmt: str, backend: str | None = None, k: int | None = None) -> str:
    """How `linear_tiles` computes (from `tiles_min_rows` rows): "int8" (the panel GEMM: the int8 scheme's codes,
    its rows not bitwise the micro-kernel's), "int16" (Q8_0 on AVX2 and AVX-512 VNNI: the panel GEMM with the int16
    scheme's codes, csrc/panels_avx2.cpp, csrc/panels_avx512_vnni.cpp) or "fp32" (weights dequantised into tiles,
    fp32 FMA). `k`: the weight's K, where it matters (Q8_0 on AVX-512 VNNI: `Q8_VNNI_PANEL_MIN_K`)."""
    backend = backend or kernel_backend()
    if fmt == "q8_0" and backend in ("avx2", "avx2_i8", "avx512_vnni", "avx512_vnni_i8"):
        if backend.startswith("avx512") and k is not None and k < Q8_VNNI_PANEL_MIN_K:
            return "fp32"
        return "int16"  # the panel GEMM with the int16 scheme's codes (vpmaddwd, vpdpwssd)
    if backend == "avx2_i8" and block_format(fmt).lut:  # fp32 tiles: see csrc/quant_ops.cpp panel_for
        return "fp32"
    return "int8" if activation_scheme(fmt, backend) == "int8" else "fp32"


def isa_index(backend: str | None = None) -> int:
    """The C++ kernel's index of a kernel path (default: the one in use, `kernel_backend`; not "torch")."""
    return _ISA_NAMES.index(backend or _backend or kernel_backend())


def activation_scheme(fmt: str, backend: str | None = None) -> str:
    """How `linear`'s micro-kernel rounds x for a weight in `fmt` (decode; every row count in deterministic mode):
    "int8" (paths avx512_vnni_i8 and avx2_i8, the defaults there, the nibble formats: per block of 32,
    d = amax / 127, vpdpbusd / vpmaddubsw; IQ4_NL/IQ4_XS on avx2_i8 with their signed table values and vpsignb),
    "int16" (every other kernel path: power-of-two scales, vpdpwssd/vpmaddwd) or "fp32" (the torch path).
    `backend`: a kernel path (default: the process's)."""
    backend = backend or kernel_backend()
    if backend == "torch":
        return "fp32"
    if backend not in _RUNS_ON or fmt == "q8_0":
        return "int16"
    return "int8"


def activation_block(fmt: str, backend: str | None = None, rows16: bool = False) -> int:
    """The values of x that share one int8 scale d = amax / 127 on the int8 scheme (`activation_scheme` "int8"):
    32 (llama.cpp's Q8_0), or 256 for the k-quants with integer block scales (q3_k .. q6_k) on avx2_i8
    (llama.cpp's Q8_K), there with a power-of-two sub-scale per block of 32, d * 2^-e, e the largest e <= 6 with
    the block's amax * 2^e <= the super-block's (csrc/quant_common.h kSubShift). The micro-kernel then sums a
    super-block's scaled blocks in int32 and scales once per 256 weights, where a scale per block of x had cost
    fp32 work per pair of blocks; the sub-scales keep each block's resolution within 2x of its own scale's (one
    d per 256 alone had cost 1.3-1.5 points of top-1 agreement on a Q4_K_M file of the default model's weights).
    The panel GEMM rounds x the same way. `rows16`: a weight in the 16-row layout, whose kernels round x per
    block of 32 on every int8 path."""
    backend = backend or kernel_backend()
    k_super = fmt in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k") and not rows16
    return 256 if backend == "avx2_i8" and k_super else BLOCK


def batch_invariant(backend: str | None = None) -> bool:
    """True when `linear`'s rows do not depend on the batch (the C++ kernel; not the torch fallback)."""
    return (backend or kernel_backend()) != "torch"


def linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None, *, invariant: bool = False,
           backend: str | None = None) -> torch.Tensor:
    """x @ W.T (+ bias): x fp32 [..., K] -> fp32 [..., N].

    From `tiles_min_rows(fmt, backend)` rows of x on, unless `invariant`, the C++ kernel takes its many-rows
    path instead: the int8 panel GEMM on the int8 paths (the nibble formats), else fp32 tiles (weights
    dequantised into cache-sized tiles, fp32 FMA); measured in docs/measurements/quant-kernels.md. Its results
    differ in the last bits from the micro-kernel's, so `invariant=True` (deterministic mode) keeps every M on
    the micro-kernel.

    With `invariant=True` (or fewer than `tiles_min_rows` rows) the C++ kernel is batch-invariant: each output
    element is one fixed sequence of operations on its own row of x (integer codes per block, exact int32 block
    sums, fp32 scaling and accumulation in block order, one fixed lane-sum tree, bias last) whatever M is,
    whatever the other rows of x are and however the threads split the work, so row m is bitwise identical for
    any batch (deterministic mode relies on it). The torch fallback (`kernel_backend() == "torch"`) does not
    promise that; see `batch_invariant()`. `backend`: the kernel path (a model's frozen choice; default: the
    process's, `kernel_backend`).
    """
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the weight expects {k}")
    backend = backend or _backend or kernel_backend()
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
    op = ops.linear if invariant or x2.shape[0] < tiles_min_rows(qw.fmt, backend) else ops.linear_tiles
    y = op.default(x2, *qw.tensors(), _REGISTRY[qw.fmt].code, bias, _ISA_NAMES.index(backend))
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def narrow_rows(qw: QuantWeight, start: int, length: int) -> QuantWeight:
    """Output rows [start, start + length) (column-parallel and vocab shards, the q/k/v split)."""
    n = qw.shape[0]
    if start < 0 or length < 0 or start + length > n:
        raise ValueError(f"narrow_rows: [{start}, {start + length}) is outside the {n} rows")
    return qw.replace(lambda t, _: t[start: start + length].contiguous(), (length, qw.shape[1]))


def narrow_cols(qw: QuantWeight, start: int, length: int) -> QuantWeight:
    """Input columns [start, start + length) (row-parallel TP). Whole blocks of the file only: start and length
    must be multiples of 32 (256 for the k-quants; length may also run to the end of a K that is not)."""
    k = qw.shape[1]
    if start < 0 or length < 0 or start + length > k:
        raise ValueError(f"narrow_cols: [{start}, {start + length}) is outside the {k} columns")
    fb = block_format(qw.fmt).file_block
    if start % fb or (length % fb and start + length != k):
        raise ValueError(f"narrow_cols: start ({start}) and length ({length}) must be multiples of {fb}, "
                         f"the {qw.fmt} block size")
    b0, nb = start // BLOCK, -(-length // BLOCK)
    per = SUPER // BLOCK

    def cols(t: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "super":
            return t[:, b0 // per: (b0 + nb) // per].contiguous()
        if kind == "plane" and block_format(qw.fmt).crumbs:  # whole quads (k-quant splits: whole super-blocks)
            return t[:, b0: b0 + -(-nb // 4) * 4].contiguous()
        if kind == "plane":  # quads of blocks: regrouped from the blocks' own words
            return _quad_planes(_block_words(t, qw.blocks)[:, b0: b0 + nb])
        return t[:, b0: b0 + nb].contiguous()

    return qw.replace(cols, (qw.shape[0], length))


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack row blocks (merged gate_up, qkv): all parts share the format and K."""
    if not parts:
        raise ValueError("cat_rows: no parts")
    fmt, k = parts[0].fmt, parts[0].shape[1]
    for p in parts:
        if p.fmt != fmt or p.shape[1] != k:
            raise ValueError(f"cat_rows: parts differ ({p.fmt}, K={p.shape[1]} vs {fmt}, K={k})")
    parts = [rows_of(p) for p in parts]
    fields = [None if parts[0].tensors()[i] is None else torch.cat([p.tensors()[i] for p in parts])
              for i in range(len(parts[0].tensors()))]
    return QuantWeight(fmt, (sum(p.shape[0] for p in parts), k), *fields)


def permute_rows(qw: QuantWeight, index: torch.Tensor) -> QuantWeight:
    """Rows reordered: row i of the result is row index[i] of `qw`."""
    index = index.to(torch.long)
    if index.dim() != 1 or index.numel() != qw.shape[0]:
        raise ValueError(f"permute_rows: index must be 1-D with {qw.shape[0]} entries, got {tuple(index.shape)}")
    return qw.replace(lambda t, _: t.index_select(0, index), qw.shape)
