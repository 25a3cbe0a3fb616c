"""Fused C++ ops for the small per-token ops of a decoder layer (servelm/kernels/csrc/fused_ops.cpp).

At batch 1 a decode step of a small model is dominated by the dispatch cost of the many tiny torch ops
around the matmuls (RMSNorm as pow/mean/rsqrt/mul, rotary as slices/cat/mul, decode attention as
index_select/baddbmm/softmax/bmm, SiLU-and-multiply); each op here replaces 3 to 15 of them with one call.

The layers call these only where `available(...)` says so: the kernel library loaded (it is built with the
quantised-weight kernels, `servelm.kernels.build`), every tensor is fp32 on CPU, deterministic mode
(`--enable-deterministic-inference`) is off (that mode keeps its own batch-invariant torch code), and the
fused ops are not switched off (`SERVELM_FUSED_OPS=0` at start-up, or `set_enabled(False)`); the KV cache may
be in any `--kv-cache-dtype` (`kv_available`). Otherwise the
layers run their torch code, which these ops match to ~1e-6 relative (no FMA, but in decode attention; exp
within ~2 ulp). Decode and prefill attention over a bf16 cache on a CPU with AVX512_BF16 take bf16 products
instead (the query and the probabilities rounded to bf16, as llama.cpp rounds q to its f16 cache's type; ~1e-3
relative); `SERVELM_FUSED_ISA=avx512` (or `set_isa`) keeps them fp32.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch

from servelm.layers import batch_invariant

ENV = "SERVELM_FUSED_OPS"
ISA_ENV = "SERVELM_FUSED_ISA"  # one of ISA_NAMES: the fused ops' instruction set from start-up (default: the best)
# servelm_fused's ISA levels (fused_ops.cpp Isa). avx512_bf16: AVX-512 on a CPU with AVX512_BF16, whose decode
# and prefill attention over a bf16 KV cache take bf16 products (docs/measurements/decode-attention.md); avx512
# keeps them fp32 there.
ISA_NAMES = ("sse2", "avx2", "avx512", "avx512_bf16")

_enabled = os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def set_enabled(enabled: bool) -> bool:
    """Use the fused ops (where available) or always the torch code from now on; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def is_enabled() -> bool:
    """The switch of `set_enabled` (not whether the library could be loaded: see `loaded`)."""
    return _enabled


@cache
def _ops() -> Any | None:
    from servelm.kernels import build

    if not build.load_quant_ops():
        return None
    forced = os.environ.get(ISA_ENV, "").strip()
    if forced:
        _set_isa(torch.ops.servelm_fused, forced)
    return torch.ops.servelm_fused


def _set_isa(ops: Any, name: str) -> str:
    if name.lower() not in ISA_NAMES:
        raise ValueError(f"fused-ops ISA {name!r}: expected one of {', '.join(ISA_NAMES)}")
    level, best = ISA_NAMES.index(name.lower()), int(ops.best_isa())
    if level > best:
        raise ValueError(f"fused-ops ISA {name!r}: this CPU supports at most {ISA_NAMES[best]}")
    return ISA_NAMES[int(ops.set_isa(level))]


def isa() -> str:
    """The fused ops' instruction set in use (`ISA_NAMES`)."""
    ops = _ops()
    if ops is None:
        raise RuntimeError("the fused kernels are not built here")
    return ISA_NAMES[int(ops.isa())]


def set_isa(name: str | None) -> str:
    """The fused ops' instruction set from now on, by name (`ISA_NAMES`; None: the best this CPU has); returns
    the one in use. A faster one than the CPU has is an error. `SERVELM_FUSED_ISA` does the same at start-up."""
    ops = _ops()
    if ops is None:
        raise RuntimeError("the fused kernels are not built here")
    return ISA_NAMES[int(ops.set_isa(-1))] if name is None else _set_isa(ops, name)


def loaded() -> bool:
    """Whether the fused kernels are built and loaded (the first call builds or loads them)."""
    return _ops() is not None


def available(*tensors: torch.Tensor, kernels: Any = None) -> bool:
    """Whether a layer should call the fused ops on these tensors: its frozen `kernels` choice (a
    servelm.layers.kernel_choice.KernelChoice) allows them, or without one the process-wide switches do."""
    if kernels is not None:
        if not kernels.fused:
            return False
    elif not _enabled or batch_invariant._ENABLED:
        return False
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return _ops() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with `residual`: (rms_norm(x + residual), x + residual)."""
    ops = _ops()
    if not x.is_contiguous():
        x = x.contiguous()
    if residual is None:
        return ops.rms_norm.default(x, weight, eps)
    if not residual.is_contiguous():
        residual = residual.contiguous()
    return ops.add_rms_norm.default(x, residual, weight, eps)


def _heads_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] as the kernel reads it: each token's [H, D] contiguous (token rows may be strided)."""
    if x.stride(-1) != 1 or (x.shape[1] > 1 and x.stride(1) != x.shape[2]):
        return x.contiguous()
    return x


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [T, H, D] and k [T, Hkv, D] at `positions` ([T] int64)."""
    if positions.dtype != torch.long or not positions.is_contiguous():
        positions = positions.to(torch.long).contiguous()
    return _ops().rotary.default(positions, _heads_rows(q), _heads_rows(k), cos, sin)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of fp32 logits [R, V] on CPU, the same indices (the first of equal maxima, a NaN
    counted as the largest) in one vectorised pass: over a verify step's 9 x 49,152 logits on a 2-core EPYC
    torch's took 210-320 us (and the greedy rows' copy before it ~150 us), this ~34 us; one row 44-57 against 10. An
    exact op, so any kernel choice (deterministic mode too) may take it; `greedy_argmax` chooses it."""
    return _ops().argmax_rows.default(x)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy tokens of logits [R, V]: `argmax_rows` where it runs (fp32 on CPU, the kernels loaded, the
    fused ops not switched off), else torch.argmax."""
    if _enabled and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2 \
            and logits.shape[1] > 0 and _ops() is not None:
        return argmax_rows(logits if logits.is_contiguous() else logits.contiguous())
    return logits.argmax(dim=-1)


def kv_available(kv: Any) -> bool:
    """Whether the fused ops read and write this layer's KV (a memory_pool.LayerKV): fp32 compute on CPU, any
    storage dtype of `--kv-cache-dtype`."""
    return kv.compute_dtype == torch.float32 and kv.k.device.type == "cpu"


def qkv_rotary_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv: Any, out_cache_loc: torch.Tensor, num_heads: int) -> torch.Tensor:
    """From a fused projection qkv [T, (H + 2 Hkv) * D]: q [T, H, D] rotated; k rotated and v written into
    the layer's KV (a memory_pool.LayerKV, encoded in its dtype) at out_cache_loc [T] (split + rotary + the
    two index_copy_ in one op)."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if positions.dtype != torch.long or not positions.is_contiguous():
        positions = positions.to(torch.long).contiguous()
    return _ops().qkv_rotary_cache.default(qkv, positions, cos, sin, kv.k, kv.v, kv.k_scale, kv.v_scale,
                                           out_cache_loc, num_heads)


def kv_encode(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The C++ encoding of rows x [N, D] into a KV storage dtype (memory_pool.encode's bits): (values, the
    float16 scales for int8 or None)."""
    x = x.float().contiguous()
    dst = torch.empty(x.shape, dtype=dtype)
    scale = torch.empty(x.shape[0], dtype=torch.float16) if dtype == torch.int8 else None
    _ops().kv_encode.default(x, dst, scale)
    return dst, scale


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate | up] over the last dim."""
    if not gate_up.is_contiguous():
        gate_up = gate_up.contiguous()
    return _ops().silu_and_mul.default(gate_up)


def decode_attention(q: torch.Tensor, kv: Any, kv_index: torch.Tensor, lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query token per request: q [B, H, D] over the first lens[b] slots of kv_index [B, L] in a layer's
    KV (a memory_pool.LayerKV, read in its storage dtype) -> [B, H * D]."""
    if not q.is_contiguous():
        q = q.contiguous()
    return _ops().decode_attention.default(q, kv.k, kv.v, kv.k_scale, kv.v_scale, kv_index, lens, scale)


def prefill_attention(q: torch.Tensor, kv: Any, index: torch.Tensor, reqs: torch.Tensor, scale: float,
                      out: torch.Tensor, causal: bool = True) -> None:
    """Causal attention of extend requests over a layer's paged KV (read in its storage dtype) into `out`
    [T, H * D]: reqs [R, 4] int64 rows (q_start, n, seq_len, index_off) say that rows q_start .. q_start + n
    of q [T, H, D] sit at positions seq_len - n .. seq_len - 1 and see the slots index[index_off ..] up to
    their own position (not `causal`: all seq_len of them, an encoder's attention). Rows of other requests
    are left as they are."""
    if not q.is_contiguous():
        q = q.contiguous()
    _ops().prefill_attention.default(q, kv.k, kv.v, kv.k_scale, kv.v_scale, index, reqs, scale, out, causal)


def decode_layer_static(layer: Any, args: tuple[list, list[int], list[int], list, list[str]], kv: Any,
                        backend: str | None = None) -> tuple[tuple, tuple, tuple]:
    """The arguments of a layer's `decode_layer` op that do not change from step to step, in three runs (before
    the positions, between them and the step's KV slots, after those): its norms, projections, rotary tables,
    KV tensors `kv` (a memory_pool.LayerKV) and kernel path."""
    from servelm.kernels import quant

    weights, fmts, parts, biases, names = args
    backend = backend or quant.kernel_backend()  # the layer's frozen quant path (default: the process's)
    tiles_from = layer.fused_tiles_from.get(backend)
    if tiles_from is None:  # per kernel path (tests switch it): where each part leaves the integer scheme
        tiles_from = [quant.tiles_min_rows(name, backend) for name in names]
        layer.fused_tiles_from[backend] = tiles_from
    attn = layer.self_attn
    return ((layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
             weights, fmts, parts, biases),
            (attn.rotary.cos, attn.rotary.sin, kv.k, kv.v, kv.k_scale, kv.v_scale),
            (attn.num_heads, attn.attn.scale, quant.isa_index(backend), tiles_from))


def _step_args(positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if positions.dtype != torch.long or not positions.is_contiguous():
        positions = positions.to(torch.long).contiguous()
    if not hidden.is_contiguous():
        hidden = hidden.contiguous()
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    return positions, hidden, residual


def decode_layer(layer: Any, args: tuple[list, list[int], list[int], list, list[str]], positions: torch.Tensor,
                 hidden: torch.Tensor, residual: torch.Tensor | None, fb: Any,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama-family decoder layer's decode step in one C++ call (`LlamaDecoderLayer.fused_decode_args`):
    the norms, the quantised projections, rotary + KV write and decode attention, as the layer's own ops
    compute them, bit for bit, without ~10 dispatches and ~40 Python frames a layer (each projection leaves the
    micro-kernel for the many-rows path from `quant.tiles_min_rows` requests, as `quant.linear` does)."""
    a, b, c = decode_layer_static(layer, args, fb.kv_cache.layer(layer.self_attn.attn.layer_id), backend)
    positions, hidden, residual = _step_args(positions, hidden, residual)
    return _ops().decode_layer.default(hidden, residual, *a, positions, *b, fb.out_cache_loc, fb.decode_kv_index,
                                       fb.decode_lens, *c)


def decode_stack_of(statics: list[tuple[tuple, tuple, tuple]]) -> Any:
    """A C++ `DecodeStack` holding every layer's `decode_layer_static` arguments (built once per KV cache and
    kernel choice), so that `decode_stack` runs a step's layers from one call."""
    stack = torch.classes.servelm_fused.DecodeStack()
    for a, b, c in statics:  # add_layer takes decode_layer's arguments less the step's (hidden, positions, slots)
        stack.add_layer(*a, *b, *c)
    return stack


def decode_stack(stack: Any, positions: torch.Tensor, hidden: torch.Tensor,
                 fb: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer's decode step, the same `decode_layer` calls as layer by layer, from one call into
    `stack` (`decode_stack_of`): without each layer's Python (module call, checks, attribute lookups: ~50 us a
    layer) and without converting each layer's ~30 arguments from Python again at every step (~40 us a layer;
    together ~1.2 ms of the default model's ~12 ms decode step on a 2-core EPYC)."""
    positions, hidden, _ = _step_args(positions, hidden, None)
    return stack.run(hidden, positions, fb.out_cache_loc, fb.decode_kv_index, fb.decode_lens)
