"""Quick all-reduce: a two-shot, block-quantised all-reduce for bandwidth-bound messages.

Why: a large all-reduce is bound by bytes on the wire, and INT8/INT6/INT4
codes with one fp32 scale per 32 values send 1.1/0.9/0.6 bytes a value
instead of 4. Two shots (reduce-scatter as one all-to-all, sum the own
segment in fp32 in rank order, re-quantise, all-gather) make every rank
dequantise the same bytes, so the result is bit-identical on every rank. It
is lossy by design: `error_bound` is the derived per-element bound the tests
check, `|out - S| <= sum_r A_r / (2q) * (2 + 1/(2q))` per block of 32 values
(q = qmax, A_r = absmax of rank r's block).
Algorithm, wire format and the derivation: docs/measurements/quick-allreduce.md;
the user contract: docs/distributed.md, "Quick all-reduce".
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from servelm.distributed.parallel_state import TPGroup, get_tp_group

BLOCK = 32
QMAX = {"int8": 127, "int6": 31, "int4": 7}
# Bytes of packed codes per block of 32 values.
_CODE_BYTES = {"int8": 32, "int6": 24, "int4": 16}
_SCALE_BYTES = 4


def _quantize(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [nblocks, 32] -> (int8 codes [nblocks, 32], fp32 scales [nblocks])."""
    qmax = QMAX[mode]
    scales = x.abs().amax(dim=1) / qmax
    # An all-zero block has scale 0: divide by 1 instead, its codes are 0 anyway.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(x / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return codes, scales


def _pack(codes: torch.Tensor, mode: str) -> torch.Tensor:
    """int8 codes [nblocks, 32] -> uint8 [nblocks, code_bytes]."""
    if mode == "int8":
        return codes.view(torch.uint8)
    u = (codes.to(torch.int32) + (QMAX[mode] + 1))  # unsigned: 1..2*qmax+1
    if mode == "int4":
        u = u.view(codes.shape[0], 16, 2)
        return (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)
    # int6: four 6-bit codes -> one 24-bit word -> three bytes
    u = u.view(codes.shape[0], 8, 4)
    w = u[..., 0] | (u[..., 1] << 6) | (u[..., 2] << 12) | (u[..., 3] << 18)
    return torch.stack((w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF), dim=-1).to(torch.uint8).view(-1, 24)


def _unpack(packed: torch.Tensor, mode: str) -> torch.Tensor:
    """uint8 [nblocks, code_bytes] -> int32 codes [nblocks, 32]."""
    if mode == "int8":
        return packed.view(torch.int8).to(torch.int32)
    bias = QMAX[mode] + 1
    p = packed.to(torch.int32)
    if mode == "int4":
        u = torch.stack((p & 0xF, p >> 4), dim=-1)
    else:
        b = p.view(p.shape[0], 8, 3)
        w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        u = torch.stack((w & 0x3F, (w >> 6) & 0x3F, (w >> 12) & 0x3F, (w >> 18) & 0x3F), dim=-1)
    return u.reshape(packed.shape[0], BLOCK) - bias


def _encode(x: torch.Tensor, rows: int, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values [rows * seg_len] -> uint8 payload [rows, payload_bytes]."""
    if mode == "fp":
        return x.to(dtype).view(rows, -1).view(torch.uint8)
    codes, scales = _quantize(x.view(-1, BLOCK), mode)
    packed = _pack(codes, mode).reshape(rows, -1)
    return torch.cat((packed, scales.view(rows, -1).view(torch.uint8)), dim=1)


def _decode(payload: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """uint8 payload [rows, payload_bytes] -> fp32 values [rows, seg_len]."""
    rows = payload.shape[0]
    if mode == "fp":
        return payload.view(dtype).to(torch.float32)
    per_block = _CODE_BYTES[mode] + _SCALE_BYTES
    nblocks = payload.shape[1] // per_block
    code_part = payload[:, : nblocks * _CODE_BYTES[mode]].reshape(rows * nblocks, _CODE_BYTES[mode])
    scales = payload[:, nblocks * _CODE_BYTES[mode]:].contiguous().view(torch.float32).reshape(-1)
    values = _unpack(code_part, mode).to(torch.float32) * scales[:, None]
    return values.view(rows, -1)


def quick_all_reduce(x: torch.Tensor, mode: str, group: TPGroup | None = None) -> torch.Tensor:
    """Sum floating-point `x` over the TP group with the two-shot quantised algorithm; returns a new tensor.

    `x` is left unchanged. The result is bit-identical on every rank.
    """
    if mode not in ("fp", *QMAX):
        raise ValueError(f"quick all-reduce mode must be fp, int8, int6 or int4, got {mode!r}")
    group = group or get_tp_group()
    ws = group.world_size
    if ws == 1:
        return x.clone()
    n = x.numel()
    seg_len = max(1, math.ceil(n / (ws * BLOCK))) * BLOCK
    padded = torch.zeros(ws * seg_len, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    # Reduce-scatter: row j of `send` (my copy of segment j) goes to rank j.
    send = _encode(padded, ws, mode, x.dtype)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.device_group)
    parts = _decode(recv, mode, x.dtype)  # [ws, seg_len]: every rank's copy of my segment
    acc = parts[0].clone()
    for r in range(1, ws):  # rank order, so every rank sums its segment the same way
        acc += parts[r]
    own = _encode(acc, 1, mode, x.dtype)
    gathered = torch.empty((ws, own.shape[1]), dtype=torch.uint8, device=x.device)
    dist.all_gather_single(gathered, own, group=group.device_group)
    return _decode(gathered, mode, x.dtype).reshape(-1)[:n].view(x.shape).to(x.dtype)


_MANTISSA_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def error_bound(inputs: Sequence[torch.Tensor], mode: str) -> torch.Tensor:
    """Per-element bound on |quick_all_reduce(x) - exact sum| given every rank's input.

    Returns fp64, shaped like one input. Assumes the block layout of
    `quick_all_reduce` (32 consecutive values of the flattened tensor per block).
    Derivation: docs/measurements/quick-allreduce.md, "Error bound".
    """
    ws = len(inputs)
    shape, dtype, n = inputs[0].shape, inputs[0].dtype, inputs[0].numel()
    seg_len = max(1, math.ceil(n / (ws * BLOCK))) * BLOCK
    absx = torch.zeros(ws, ws * seg_len, dtype=torch.float64)
    for r, x in enumerate(inputs):
        absx[r, :n] = x.reshape(-1).double().abs()
    eps32 = 2.0 ** -24
    if mode == "fp":
        # fp32 rank-order sum: each of ws-1 additions rounds by <= eps32 * |partial| <= eps32 * sum|x_r|.
        total = absx.sum(0)
        bound = (ws - 1) * eps32 * total
        magnitude = total
    else:
        q = QMAX[mode]
        sum_absmax = absx.view(ws, -1, BLOCK).amax(dim=2).sum(0)  # [nblocks]: sum_r A_r
        quant = sum_absmax / (2 * q) * (2 + 1 / (2 * q))
        magnitude = sum_absmax * (1 + 1 / q)
        # fp32 ops on values <= magnitude: divide, round, multiply per round, ws-1 adds, final add.
        fp32_slack = (ws + 6) * eps32 * magnitude
        bound = (quant + fp32_slack).repeat_interleave(BLOCK)
        magnitude = magnitude.repeat_interleave(BLOCK)
    if dtype != torch.float32:
        bound = bound + magnitude * 2.0 ** -_MANTISSA_BITS[dtype]  # half an ulp of the output cast
    return bound[:n].view(shape)


def bench_all_reduce(sizes: Sequence[int], modes: Sequence[str], iters: int = 20,
                     dtype: torch.dtype = torch.float32) -> list[dict[str, float | int | str]]:
    """Time each all-reduce mode per message size (bytes) on the current TP group; collective on all ranks.

    Mode "none" is the plain `dist.all_reduce`, "deterministic" the
    deterministic all-reduce, the others quick all-reduce. Returns rows of
    {mode, bytes, us (median per call), gbps (algorithm bandwidth), max_rel_err}
    (error vs the exact fp64 sum of every rank's input, relative to its absmax).
    """
    from servelm.distributed.deterministic import deterministic_all_reduce

    group = get_tp_group()
    rows: list[dict[str, float | int | str]] = []
    for size in sizes:
        numel = max(1, size // dtype.itemsize)
        gen = torch.Generator().manual_seed(1234 + group.rank)
        x = torch.randn(numel, generator=gen).to(dtype)
        everyone = [torch.randn(numel, generator=torch.Generator().manual_seed(1234 + r)).to(dtype)
                    for r in range(group.world_size)]
        exact = torch.stack([e.double() for e in everyone]).sum(0)
        for mode in modes:
            def call(mode: str = mode, x: torch.Tensor = x) -> torch.Tensor:
                if mode == "none":
                    y = x.clone()
                    dist.all_reduce(y, group=group.device_group)
                    return y
                if mode == "deterministic":
                    return deterministic_all_reduce(x, group)
                return quick_all_reduce(x, mode, group)
            out = call()
            err = ((out.double() - exact).abs().max() / exact.abs().max()).item()
            times = []
            for _ in range(iters):
                dist.barrier(group=group.cpu_group)
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            us = sorted(times)[len(times) // 2] * 1e6
            rows.append({"mode": mode, "bytes": numel * dtype.itemsize, "us": us,
                         "gbps": numel * dtype.itemsize / us / 1e3, "max_rel_err": err})
    return rows
