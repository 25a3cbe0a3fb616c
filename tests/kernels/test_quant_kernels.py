"""servelm.kernels.quant: the C++ kernel (each ISA this CPU has, and the scalar path) and the torch fallback
against a plain dequantise-then-matmul reference; ggml block compatibility; batch invariance; row/column ops."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from servelm.kernels import build, quant
from tests.models.gguf_files import random_k_quant as _random_k

GGML = {fmt: quant.block_format(fmt).ggml for fmt in quant.FORMATS}
ISAS = ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_vnni_i8", "avx2_i8")


def _kernel_paths() -> list[str]:
    quant.force_backend(None)
    return [p for p in quant.available_backends() if p != "torch"] or ["torch"]


PATHS = _kernel_paths() + (["torch"] if _kernel_paths() != ["torch"] else [])
INT8_PATHS = [p for p in ("avx2_i8", "avx512_vnni_i8") if p in PATHS]
KERNELS = [p for p in PATHS if p != "torch"]


@pytest.fixture
def path(request):
    assert quant.force_backend(request.param) == request.param == quant.kernel_backend()
    yield request.param
    quant.force_backend(None)


def _weight(n: int, k: int, fmt: str, seed: int = 0) -> tuple[torch.Tensor, quant.QuantWeight]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    return w, quant.quantize(w, fmt)


def _int8_steps(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per block of 32 of x (padded), the int8 scheme's step, float64: max |x| / 127 over the block (group 32), or
    for the k-quants on AVX2 (group 256, `quant.activation_block`) the super-block's d = max |x| / 127 times the
    block's power-of-two sub-scale 2^-e, e the largest e <= 6 with the block's max |x| * 2^e <= the
    super-block's (C++ kSubShift)."""
    xb = torch.nn.functional.pad(x.double(), (0, -x.shape[-1] % group)).unflatten(-1, (-1, quant.BLOCK))
    amax = xb.abs().amax(-1, keepdim=True)
    if group == quant.BLOCK:
        return amax / 127
    sup = amax.unflatten(-2, (-1, group // quant.BLOCK)).amax(-2, keepdim=True).expand(
        *amax.shape[:-2], -1, group // quant.BLOCK, 1).flatten(-3, -2)
    e = torch.zeros_like(amax)
    for k in range(1, 7):
        e = torch.where(amax * 2.0 ** k <= sup, torch.full_like(e, k), e)
    return sup / 127 * torch.pow(2.0, -e)


def _code_step(x: torch.Tensor, scheme: str = "int16", group: int = quant.BLOCK) -> torch.Tensor:
    """Per element of x, the step of the kernel's codes: int16 2^(e - 15) for its block's max |x| = f * 2^e,
    int8 `_int8_steps` (group: `quant.activation_block`)."""
    k = x.shape[-1]
    if scheme == "int8":
        return _int8_steps(x, group).expand(*x.shape[:-1], -1, quant.BLOCK).flatten(-2)[..., :k]
    blocks = torch.nn.functional.pad(x, (0, -k % quant.BLOCK)).unflatten(-1, (-1, quant.BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True)
    _, e = torch.frexp(amax)
    return torch.ldexp(torch.ones(()), (e - 15).double()).expand_as(blocks).flatten(-2)[..., :k]


def _int8_reference(x: torch.Tensor, qw: quant.QuantWeight) -> torch.Tensor:
    """The int8 scheme in float64: x rounded per block of 32 to round(x / step) (`_int8_steps`: max |x| / 127, or
    on the k-quants on AVX2 the super-block's with the block's power-of-two sub-scale), the whole weight (codes
    and minimum) against the rounded x: the minimum term reads the sum of the rounded block, as llama.cpp's
    q8_1 and q8_K (the exact sum of x would leave an error of sum(d * code * e), as large as |w - m|)."""
    k = qw.blocks * quant.BLOCK
    xp = torch.nn.functional.pad(x.double(), (0, k - x.shape[-1]))
    step = _int8_steps(xp, quant.activation_block(qw.fmt))
    xb = xp.unflatten(-1, (-1, quant.BLOCK))
    codes = torch.round(xb * torch.where(step > 0, 1 / step, torch.zeros_like(step))).clamp(-127, 127)
    xq = (codes * step).flatten(-2)
    w = quant.dequantize(qw).double()
    return xq @ torch.nn.functional.pad(w, (0, k - w.shape[1])).T


def _without_min(qw: quant.QuantWeight) -> quant.QuantWeight:
    """The same weight with its minimums zeroed (scale * code alone)."""
    return dataclasses.replace(qw, shape=(qw.shape[0], qw.blocks * quant.BLOCK), m=torch.zeros_like(qw.m))


def _check_close(y: torch.Tensor, x: torch.Tensor, qw: quant.QuantWeight, bias: torch.Tensor | None,
                 rows16: bool = False) -> None:
    """y = x @ W.T (+ bias) within fp32 rounding and half a step of x's codes an element. `rows16`: y came from
    the weight in the 16-row layout (one kernel at every M, x per block of 32)."""
    w = quant.dequantize(qw).double()
    ref = x.double() @ w.T + (bias.double() if bias is not None else 0)
    bound = (x.double().abs() @ w.abs().T) * 2e-6 + 1e-6  # fp32 rounding of a K-term sum, generously
    scheme = quant.activation_scheme(qw.fmt)
    many = x.shape[0] >= quant.tiles_min_rows(qw.fmt, quant.kernel_backend())
    if scheme != "fp32" and many and not rows16:
        scheme = quant.many_rows_scheme(qw.fmt, k=x.shape[-1])  # the many-rows path: fp32 tiles or a panel GEMM
    if scheme != "fp32":  # x rounded to codes: half a step an element
        block = quant.activation_block(qw.fmt, rows16=rows16)
        bound = bound + (_code_step(x.double(), scheme, block) / 2) @ w.abs().T
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert bool(((y.double() - ref).abs() <= bound).all()), float((y.double() - ref).abs().max())


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("fmt", quant.QUANTIZE_FORMATS)
def test_linear_matches_dequantised_matmul(path, fmt):
    g = torch.Generator().manual_seed(1)
    # N odd, K not a multiple of 32 (padded by quantize); KB % 4 = 3, 3, 2, 1 (the quad loops' tails)
    for n, k in ((67, 70), (131, 96), (13, 575), (29, 130)):
        _, qw = _weight(n, k, fmt, seed=n)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 5, 6, 7, 13, 37, 70):
            x = torch.randn(m, k, generator=g)
            _check_close(quant.linear(x, qw, bias if m % 2 else None), x, qw, bias if m % 2 else None)
    x3 = torch.randn(2, 3, 70, generator=g)  # leading dims kept
    assert quant.linear(x3, _weight(67, 70, fmt)[1]).shape == (2, 3, 67)


@pytest.mark.parametrize("path", KERNELS, indirect=True)
@pytest.mark.parametrize("fmt", quant.QUANTIZE_FORMATS)
def test_kernel_dequantises_exactly(path, fmt):
    """x = identity: each output is one weight times 1 plus zeros, so the kernel's own dequantised values show."""
    _, qw = _weight(77, 70, fmt, seed=3)
    _check_identity(qw, 70)


def _check_identity(qw: quant.QuantWeight, k: int) -> None:
    """x = identity rows through the many-rows path (70 rows: fp32 tiles or the int8 panel GEMM) and the
    micro-kernel: fp32 tiles and the int16 scheme's power-of-two scales give the dequantised weights bit for
    bit, the int8 scheme's d_x = 1/127 to fp32 rounding of (d_w * d_x) * 127q (two roundings: 2^-23 of the
    weight)."""
    eye, want = torch.eye(k), quant.dequantize(qw).T
    # the terms' sizes: |scale * code| + |min| (a minimum adds one more rounding after the product)
    if quant.block_format(qw.fmt).has_min or quant.block_format(qw.fmt).split_min:
        scaled = quant.dequantize(_without_min(qw))[:, : qw.shape[1]]
        terms = (scaled.abs() + (quant.dequantize(qw) - scaled).abs()).T
    elif quant.activation_block(qw.fmt) > quant.BLOCK and qw.qh is not None:
        # Q6_K with x per super-block: its offset (-32 * scale * x's codes; block j's in int32 lane j) and the
        # unsigned codes' products (a pair's blocks in lanes 0-3 and 4-7) share lanes but not per block, and the
        # lanes are converted one by one: |scale * (code + 32)| + |scale * 32| (code 0's value is -32 * scale)
        base = quant.dequantize(quant.QuantWeight(qw.fmt, qw.shape, torch.zeros_like(qw.qs), qw.d, qw.m,
                                                  torch.zeros_like(qw.qh), qw.qh2, qw.sc)).T
        terms = (want - base).abs() + base.abs()
    else:
        terms = want.abs()

    def check(got: torch.Tensor, rows: slice, scheme: str) -> None:
        if scheme == "int8":
            assert bool(((got - want[rows]).abs() <= terms[rows] * 2.0 ** -21).all())
        else:
            assert torch.equal(got, want[rows])

    tiles = torch.ops.servelm_quant.linear_tiles.default(
        torch.nn.functional.pad(eye[:70], (0, qw.blocks * quant.BLOCK - k)), *qw.tensors(),
        quant.block_format(qw.fmt).code, None, quant.isa_index())
    check(tiles, slice(0, 70), quant.many_rows_scheme(qw.fmt))
    many = 70 >= quant.tiles_min_rows(qw.fmt, quant.kernel_backend())  # what `linear` takes for 70 rows
    check(quant.linear(eye[:70], qw), slice(0, 70),
          quant.many_rows_scheme(qw.fmt) if many else quant.activation_scheme(qw.fmt))
    for rows in (slice(0, 70), slice(33, 34)):
        check(quant.linear(eye[rows], qw, invariant=True), rows, quant.activation_scheme(qw.fmt))


@pytest.mark.parametrize("path", KERNELS, indirect=True)
@pytest.mark.parametrize("fmt", quant.QUANTIZE_FORMATS)
def test_linear_is_batch_invariant(path, fmt):
    """With invariant=True (deterministic mode), row m is bitwise the same alone, in a batch of 37 with other
    rows, and with 1 or 2 threads. Without it, `tiles_min_rows` rows on take the many-rows path (fp32 tiles or
    the int8 panel GEMM): close, not the same bits."""
    assert quant.batch_invariant()
    g = torch.Generator().manual_seed(2)
    _, qw = _weight(200, 576, fmt, seed=4)
    bias = torch.randn(200, generator=g)
    x = torch.randn(37, 576, generator=g)
    full = quant.linear(x, qw, bias, invariant=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for m in (0, 5, 36):
            assert torch.equal(quant.linear(x[m: m + 1], qw, bias), full[m: m + 1])
            assert torch.equal(quant.linear(x[m: m + 1], qw, bias, invariant=True), full[m: m + 1])
        other = torch.cat([x[:3], torch.randn(30, 576, generator=g) * 100])
        assert torch.equal(quant.linear(other, qw, bias, invariant=True)[:3], full[:3])
        for n in (2, 4, 5, 8):  # tiles of 1-5 rows of x (a verify step's 5: one tile, x read from L1)
            assert torch.equal(quant.linear(x[:n], qw, bias, invariant=True), full[:n])
        many = torch.cat([x, torch.randn(quant.tiles_min_rows(fmt, path), 576, generator=g)])
        tiles = quant.linear(many, qw, bias)
        assert not torch.equal(tiles[:37], full)
        _check_close(tiles, many, qw, bias)
        for m in (0, 5, 36):  # the integer scheme's rows, each within its own rounding bound
            _check_close(full[m: m + 1], x[m: m + 1], qw, bias)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", KERNELS, indirect=True)
@pytest.mark.parametrize("fmt", ["q4_k", "q4_0", "q8_0"])
def test_weight_rows_shared_by_work_stealing_give_the_one_thread_bits(path, fmt):
    """The threads share a linear's weight rows in chunks taken from an atomic counter (csrc over_weight_rows: 8
    chunks a thread, 2 for one row of x and for these small weights at 2-15 rows), the last one short: with two
    threads every output is written, and is
    bitwise the one-thread output, in the row layout and the 16-row one, at one row of x and at many, on the
    micro-kernels and on the many-rows path (panel GEMM or fp32 tiles)."""
    g = torch.Generator().manual_seed(8)
    # 38 units of 16 weight rows (chunks of 3 at M = 40, of 10 at M = 1, 2 and 5; the last one short), with a tail
    # of 5 rows in the row layout; 37 units in the 16-row one (whole groups only)
    k = 512
    layouts = [_rows16_weight(fmt, 16 * 37 + 5, k, seed=5)]
    if path in ROWS16_PATHS and fmt in ROWS16:
        rows16 = _rows16_weight(fmt, 16 * 37, k, seed=6)
        layouts.append((rows16, quant.interleave_rows16(rows16)))
    threads = torch.get_num_threads()
    try:
        for w in layouts:
            qw, w = w if isinstance(w, tuple) else (w, w)
            bias = torch.randn(qw.shape[0], generator=g)
            for m in (1, 2, 5, 40):
                x = torch.randn(m, k, generator=g)
                for invariant in (True, False):  # False, 40 rows: the many-rows path (a panel GEMM, fp32 tiles)
                    torch.set_num_threads(1)
                    one = quant.linear(x, w, bias, invariant=invariant)
                    torch.set_num_threads(2)
                    two = quant.linear(x, w, bias, invariant=invariant)
                    assert torch.equal(two, one), (m, w.qs.dim(), invariant)
                # every output written, within its path's rounding bound (_check_close picks the path as `linear`
                # does without invariant=True)
                _check_close(two, x, qw, bias, rows16=w is not qw)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("avx512_vnni" not in KERNELS, reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("fmt", quant.QUANTIZE_FORMATS)
def test_vnni_and_plain_avx512_give_the_same_bits(fmt):
    """Both compute the same exact int32 block sums (vpdpwssd vs vpmaddwd + vpaddd), then the same fp32 steps;
    so does the int8 variant's q8_0, which keeps the int16 scheme."""
    g = torch.Generator().manual_seed(5)
    _, qw = _weight(75, 600, fmt, seed=6)
    x = torch.randn(9, 600, generator=g)
    isas = ("avx512", "avx512_vnni") + (("avx512_vnni_i8",) if fmt == "q8_0" else ())
    try:
        outs = [quant.force_backend(isa) and quant.linear(x, qw) for isa in isas]
    finally:
        quant.force_backend(None)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def _check_int8_scheme(qw: quant.QuantWeight, k: int, seed: int, path: str) -> None:
    g = torch.Generator().manual_seed(seed)
    try:
        assert quant.force_backend(path) and quant.activation_scheme(qw.fmt) == "int8"
        for m in (1, 2, 3, 7):
            x = torch.randn(m, k, generator=g)
            x[0, :32] *= 1000  # blocks of very different scales
            ref = _int8_reference(x, qw)
            y = quant.linear(x, qw, invariant=True).double()
            # fp32 sums of exact integer lanes: 1e-5 of the sum of |terms| (a code that rounds the other way
            # at an exact tie between fp32 and float64 moves one term by a step: far inside this)
            scale = (x.double().abs() @ quant.dequantize(qw).double().abs().T)
            assert bool(((y - ref).abs() <= 1e-5 * scale + 1e-6).all()), float(((y - ref).abs() / scale).max())
    finally:
        quant.force_backend(None)


@pytest.mark.parametrize("path", INT8_PATHS)
@pytest.mark.parametrize("fmt", [f for f in quant.QUANTIZE_FORMATS if f != "q8_0"])
def test_int8_scheme_matches_its_reference(fmt, path):
    """The nibble formats under VNNI: x rounded per block to int8 codes (llama.cpp's Q8_0 activations), exact
    int32 dot products with the offset taken out in the integers, fp32 scaling: as the float64 reference."""
    _check_int8_scheme(_weight(75, 600, fmt, seed=6)[1], 600, seed=5, path=path)


@pytest.mark.parametrize("path", KERNELS, indirect=True)
def test_nan_and_inf_in_x_propagate(path):
    _, qw = _weight(40, 96, "q4_1", seed=7)
    x = torch.randn(3, 96)
    x[0, 5], x[1, 70] = float("nan"), float("inf")
    y = quant.linear(x, qw)
    assert bool(y[:2].isnan().all()) and bool(y[2].isfinite().all())


@pytest.mark.parametrize("fmt", quant.QUANTIZE_FORMATS)
def test_quantize_is_ggml_reference_and_round_trips_blocks(fmt):
    w, qw = _weight(9, 70, fmt)
    padded = torch.nn.functional.pad(w, (0, 26)).numpy()
    assert np.array_equal(quant.to_gguf(qw), gguf_quantize(padded, GGML[fmt]))
    expected = gguf_dequantize(quant.to_gguf(qw), GGML[fmt])[:, :70]
    assert np.array_equal(quant.dequantize(qw).numpy(), expected)
    again = quant.from_gguf(quant.to_gguf(qw), fmt, (9, 70))
    assert torch.equal(again.qs, qw.qs) and torch.equal(again.d, qw.d)
    # KB = 3 is odd: a row's last pair word of fifth bits has 4 unused bytes
    assert qw.nbytes == 9 * 3 * quant.bytes_per_block(fmt) + 9 * 4 * quant.block_format(fmt).planes


def test_from_gguf_real_blocks_of_the_default_model():
    from servelm.model_loader.default_model import default_model_path

    reader = GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    for name, fmt in (("blk.0.ffn_down.weight", "q4_1"), ("blk.3.attn_q.weight", "q4_1"),
                      ("token_embd.weight", "q8_0")):
        t = tensors[name]
        raw = np.asarray(t.data[:50])  # 50 rows of ggml blocks
        k = int(t.shape[0])
        qw = quant.from_gguf(raw, fmt, (50, k))
        assert qw.fmt == fmt and qw.shape == (50, k)
        assert np.array_equal(quant.dequantize(qw).numpy(), gguf_dequantize(raw, t.tensor_type))
        ids = torch.tensor([[0, 7], [49, 3]])
        assert torch.equal(quant.embedding(ids, qw), quant.dequantize(qw)[ids])
    q4_0_raw = gguf_quantize(gguf_dequantize(np.asarray(tensors["blk.0.attn_k.weight"].data[:20]),
                                             GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_0)
    qw = quant.from_gguf(q4_0_raw, "q4_0", (20, 576))
    assert np.array_equal(quant.dequantize(qw).numpy(), gguf_dequantize(q4_0_raw, GGMLQuantizationType.Q4_0))


def test_bad_input_is_a_clear_error():
    _, qw = _weight(8, 64, "q4_1")
    with pytest.raises(ValueError, match="unknown quantisation format"):
        quant.from_gguf(np.zeros((2, 18), np.uint8), "iq2_xxs", (2, 32))
    with pytest.raises(ValueError, match="bytes per row"):
        quant.from_gguf(np.zeros((8, 39), np.uint8), "q4_1", (8, 64))
    with pytest.raises(ValueError, match="features"):
        quant.linear(torch.zeros(1, 63), qw)
    with pytest.raises(ValueError, match="multiples of 32"):
        quant.narrow_cols(qw, 16, 32)
    with pytest.raises(ValueError, match="outside"):
        quant.narrow_rows(qw, 4, 5)


@pytest.mark.parametrize("fmt", quant.QUANTIZE_FORMATS)
def test_row_and_column_operations(fmt):
    _, qw = _weight(10, 100, fmt)
    full = quant.dequantize(qw)
    parts = [quant.narrow_rows(qw, 0, 3), quant.narrow_rows(qw, 3, 7)]
    assert torch.equal(quant.dequantize(parts[0]), full[:3])
    back = quant.cat_rows(parts)
    assert back.shape == qw.shape and torch.equal(quant.dequantize(back), full)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    permuted = quant.permute_rows(qw, perm)
    assert torch.equal(quant.dequantize(permuted), full[perm])
    assert torch.equal(quant.dequantize(quant.permute_rows(permuted, torch.argsort(perm))), full)
    left, right = quant.narrow_cols(qw, 0, 64), quant.narrow_cols(qw, 64, 36)  # the tail may end off-block
    assert torch.equal(quant.dequantize(left), full[:, :64]) and torch.equal(quant.dequantize(right), full[:, 64:])
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(10))
    split = quant.linear(x[:, :64], left) + quant.linear(x[:, 64:], right)  # row-parallel TP: partial sums
    assert bool(((split - quant.linear(x, qw)).abs() <= 1e-6 * (x.abs() @ full.abs().T)).all())
    with pytest.raises(ValueError, match="differ"):
        quant.cat_rows([qw, quant.narrow_cols(qw, 0, 64)])


def test_no_compiler_falls_back_to_torch_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(build, "_missing_tools", lambda: "no C++ compiler (c++) on PATH")
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load_quant_ops.__wrapped__() is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "torch path" in lines[0] and "no C++ compiler" in lines[0]


def test_forcing_a_path(monkeypatch):
    try:
        assert quant.force_backend("torch") == "torch" and not quant.batch_invariant()
        with pytest.raises(ValueError, match="expected one of"):
            quant.force_backend("avx9000")
        monkeypatch.setenv(quant.FORCE_ENV, "scalar")
        monkeypatch.setattr(quant, "_backend", None)  # as at start-up: the variable is read on first use
        assert quant.kernel_backend() == ("scalar" if KERNELS else "torch")
    finally:
        quant.force_backend(None)


def test_torch_fallback_dequantises_a_slice_of_rows_at_a_time(monkeypatch):
    qw, bias, x = quant.quantize(torch.randn(37, 64), "q4_1"), torch.randn(37), torch.randn(5, 64)
    try:
        quant.force_backend("torch")
        whole = quant.linear(x, qw, bias)
        monkeypatch.setattr(quant, "TORCH_ROWS", 8)  # 37 rows in slices of 8: the same product
        torch.testing.assert_close(quant.linear(x, qw, bias), whole, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(whole, torch.nn.functional.linear(x, quant.dequantize(qw), bias), rtol=1e-5,
                                   atol=1e-5)
    finally:
        quant.force_backend(None)


# formats gguf-py cannot quantise (the k-quants, IQ4_NL): random blocks (`random_k_quant`)
K_QUANTS = tuple(f for f in quant.FORMATS if f not in quant.QUANTIZE_FORMATS)
SUPER = tuple(f for f in K_QUANTS if quant.block_format(f).super_block)
@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_blocks_hold_ggufs_values_in_the_files_bytes(fmt):
    """The k-quants (and IQ4_NL) are kept at their own bits: rearranged into 32-weight blocks, they dequantise to
    gguf's own values bit for bit (the nibble, bit-plane, scale and lookup layouts) in at most 1.03x the file's
    bytes (Q3_K: 114 bytes a super-block against 110, its 6-bit scales unpacked to bytes)."""
    n, k = 7, 768
    raw, qw = _random_k(fmt, n, k, seed=8)
    assert qw.fmt == fmt and qw.shape == (n, k)
    expected = gguf_dequantize(raw, GGML[fmt]).reshape(n, k)
    assert np.array_equal(quant.dequantize(qw).numpy(), expected)
    # Q6_K, IQ4_NL 1.0x; Q4_K/Q5_K unpack 12 scale bytes to 16
    assert raw.nbytes <= qw.nbytes <= {"q3_k": 114 / 110}.get(fmt, 1.03) * raw.nbytes
    ids = torch.tensor([[0, 6], [3, 3]])
    assert torch.equal(quant.embedding(ids, qw), quant.dequantize(qw)[ids])


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_linear_matches_dequantised_matmul(path, fmt):
    g = torch.Generator().manual_seed(12)
    for n, k in ((67, 256), (13, 768)):
        _, qw = _random_k(fmt, n, k, seed=n)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 5, 7, 13, 37, 70):
            x = torch.randn(m, k, generator=g)
            _check_close(quant.linear(x, qw, bias if m % 2 else None), x, qw, bias if m % 2 else None)


@pytest.mark.parametrize("path", KERNELS, indirect=True)
@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_kernel_dequantises_exactly_and_is_batch_invariant(path, fmt):
    _, qw = _random_k(fmt, 77, 512, seed=3)
    _check_identity(qw, 512)
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(4))
    full = quant.linear(x, qw, invariant=True)
    for m in (0, 5, 36):
        assert torch.equal(quant.linear(x[m: m + 1], qw), full[m: m + 1])
    for n in (4, 5):
        assert torch.equal(quant.linear(x[:n], qw, invariant=True), full[:n])


def _int8_cases(formats) -> list[tuple[str, str]]:
    """(format, path) where the path's micro-kernel takes the int8 scheme."""
    return [(f, p) for f in formats for p in INT8_PATHS if quant.activation_scheme(f, p) == "int8"]


@pytest.mark.parametrize(("fmt", "path"), _int8_cases(K_QUANTS))
def test_k_quant_int8_scheme_matches_its_reference(fmt, path):
    _check_int8_scheme(_random_k(fmt, 75, 512, seed=6)[1], 512, seed=5, path=path)


@pytest.mark.parametrize("path", KERNELS, indirect=True)
@pytest.mark.parametrize("fmt", list(quant.QUANTIZE_FORMATS) + list(K_QUANTS))
def test_rows_streamed_one_at_a_time_give_the_tiles_bits(path, fmt):
    """At one or two rows of x and weight rows of 64+ blocks (quant_common.h's stream_rows) the micro-kernels
    walk the weight rows one at a time, one sequential stream; from three rows of x in tiles of four weight
    rows. Each output's operations are the same either way: the same bits (deterministic mode's batch
    invariance), over N not a multiple of four and, for the 32-weight formats, a partial last quad."""
    k = 2048 if fmt in SUPER else 2048 + 96
    qw = _random_k(fmt, 67, k, seed=31)[1] if fmt in K_QUANTS else _weight(67, k, fmt, seed=31)[1]
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(32))
    x[0, :32] *= 1000
    tiles = quant.linear(x, qw, invariant=True)
    for m in range(5):
        assert torch.equal(quant.linear(x[m: m + 1], qw, invariant=True), tiles[m: m + 1])
    assert torch.equal(quant.linear(x[1:3], qw, invariant=True), tiles[1:3])
    if quant.activation_scheme(fmt) == "int8":
        _check_int8_scheme(qw, k, seed=33, path=path)
    else:
        _check_close(quant.linear(x[:2], qw, invariant=True), x[:2], qw, None)


def test_pack_weights_moves_every_field_into_one_buffer():
    """`quant.pack_weights` (the model runner's, after loading): each weight's fields become 64-byte aligned views
    of one buffer, a weight held twice (a tied head) is packed once, and every value and output stays the same."""
    g = torch.Generator().manual_seed(41)
    ws = [_weight(67, 70, "q4_1", seed=1)[1], _random_k("q6_k", 13, 256, seed=2)[1], _weight(5, 64, "q5_0", seed=3)[1]]
    ws.append(ws[0])
    xs = [torch.randn(3, w.shape[1], generator=g) for w in ws]
    before = [(quant.dequantize(w), quant.linear(x, w)) for w, x in zip(ws, xs, strict=True)]
    fields = sum(1 for w in ws[:3] for t in w.tensors() if t is not None)
    assert quant.pack_weights(ws) >= sum(w.nbytes for w in ws[:3])
    tensors = [t for w in ws[:3] for t in w.tensors() if t is not None]
    assert len(tensors) == fields
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.data_ptr() % 64 == 0 and t.is_contiguous() for t in tensors)
    for w, x, (deq, y) in zip(ws, xs, before, strict=True):
        assert torch.equal(quant.dequantize(w), deq) and torch.equal(quant.linear(x, w), y)
    assert quant.pack_weights([]) == 0


def test_pack_weights_leaves_large_fields_where_they_are(monkeypatch):
    """Fields from `_PACK_BELOW` bytes on (numpy gave those huge pages already) are not copied."""
    monkeypatch.setattr(quant, "_PACK_BELOW", 1024)
    qw = _weight(67, 70, "q4_1", seed=1)[1]  # qs 67 x 48 bytes; d and m 67 x 3 x 2
    qs = qw.qs
    x = torch.randn(2, 70, generator=torch.Generator().manual_seed(42))
    y = quant.linear(x, qw)
    assert quant.pack_weights([qw]) == 2 * 448  # d and m, each 402 bytes rounded up to 64
    assert qw.qs is qs and qw.d.untyped_storage().data_ptr() == qw.m.untyped_storage().data_ptr() != \
        qs.untyped_storage().data_ptr()
    assert torch.equal(quant.linear(x, qw), y)


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_row_and_column_operations(fmt):
    _, qw = _random_k(fmt, 10, 768, seed=9)
    full = quant.dequantize(qw)
    back = quant.cat_rows([quant.narrow_rows(qw, 0, 3), quant.narrow_rows(qw, 3, 7)])
    assert torch.equal(quant.dequantize(back), full)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quant.dequantize(quant.permute_rows(qw, perm)), full[perm])
    left, right = quant.narrow_cols(qw, 0, 256), quant.narrow_cols(qw, 256, 512)  # whole super-blocks
    assert torch.equal(quant.dequantize(left), full[:, :256]) and torch.equal(quant.dequantize(right), full[:, 256:])
    x = torch.randn(4, 768, generator=torch.Generator().manual_seed(10))
    split = quant.linear(x[:, :256], left) + quant.linear(x[:, 256:], right)  # row-parallel TP: partial sums
    # the same codes and block products; only the fp32 summation order differs: a few ulps of the sum of |terms|
    terms = x.abs() @ full.abs().T
    assert bool(((split - quant.linear(x, qw)).abs() <= 1e-6 * terms).all())
    with pytest.raises(ValueError, match="not one of"):
        quant.quantize(torch.zeros(2, 256), fmt)
    if fmt not in SUPER:  # IQ4_NL: 32-weight blocks, written back as they came
        raw, qw = _random_k(fmt, 10, 768, seed=9)
        assert np.array_equal(quant.to_gguf(qw), raw)
        assert torch.equal(quant.dequantize(quant.narrow_cols(qw, 96, 64)), full[:, 96:160])
        return
    with pytest.raises(ValueError, match="multiples of 256"):
        quant.narrow_cols(qw, 128, 128)  # inside a super-block: its d and scales cannot be split
    with pytest.raises(ValueError, match="32-weight formats"):
        quant.to_gguf(qw)


def _check_panel_against_micro_kernel(fmt: str, path: str, shapes: tuple[tuple[int, int], ...] = ()) -> None:
    """The many-rows path (`linear_tiles`: a panel GEMM) against the micro-kernel's rows (`invariant=True`): the
    same codes of x and exact int32 block products, in another fp32 order, so within fp32 rounding; over N not a
    multiple of the panel or micro-tile, K not a multiple of 16 blocks, x in several L2 blocks of rows (K = 4,608
    from 70 rows) and outer blocks (500 rows), blocks of very different scales, and a bias. From
    `tiles_min_rows` rows `linear` takes it."""
    g = torch.Generator().manual_seed(21)
    shapes = shapes or (((67, 256), (13, 768), (40, 4608)) if fmt in SUPER else ((67, 70), (13, 575), (40, 4608)))
    try:
        quant.force_backend(path)
        for n, k in shapes:
            qw = _random_k(fmt, n, k, seed=n)[1] if fmt in K_QUANTS else _weight(n, k, fmt, seed=n)[1]
            bias = torch.randn(n, generator=g)
            for m in (16, 37, 70, 130) + ((500,) if k == 4608 else ()):  # 500: two outer blocks of x's rows
                x = torch.randn(m, k, generator=g)
                x[0, :32] *= 1000
                x[m // 2, -40:] = 0
                many = torch.ops.servelm_quant.linear_tiles.default(
                    torch.nn.functional.pad(x, (0, qw.blocks * quant.BLOCK - k)), *qw.tensors(),
                    quant.block_format(fmt).code, bias, quant.isa_index())
                micro = quant.linear(x, qw, bias, invariant=True)
                scale = x.double().abs() @ quant.dequantize(qw).double().abs().T + bias.double().abs()
                assert bool(((many.double() - micro.double()).abs() <= 2e-6 * scale).all()), (n, k, m)
                if m >= quant.tiles_min_rows(fmt, path):
                    assert torch.equal(quant.linear(x, qw, bias), many)
    finally:
        quant.force_backend(None)


@pytest.mark.parametrize(("fmt", "path"), [
    (f, p) for f, p in _int8_cases([f for f in quant.QUANTIZE_FORMATS if f != "q8_0"] + list(K_QUANTS))
    if quant.many_rows_scheme(f, p) == "int8"])
def test_int8_panel_gemm_matches_the_micro_kernel(fmt, path):
    """The int8 panel GEMM (many rows on the int8 paths) rounds x to the micro-kernel's int8 codes."""
    _check_panel_against_micro_kernel(fmt, path)


@pytest.mark.parametrize("path", [p for p in KERNELS if quant.many_rows_scheme("q8_0", p) == "int16"])
def test_q8_0_panel_gemm_matches_the_int16_micro_kernel(path):
    """Q8_0's many rows on AVX2 and AVX-512 VNNI take a panel GEMM with the int16 scheme's codes of x, exactly
    its micro-kernel's (vpmaddwd / vpdpwssd), not fp32 tiles: int8 codes of x had cost the default model 1.8-2.4
    points of teacher-forced top-1 agreement with fp32 in --quantization int8 (tests/models/test_quantized_quality)."""
    assert quant.activation_scheme("q8_0", path) == "int16"
    shapes = ((67, 70), (13, 575), (40, 4608)) if path.startswith("avx2") else ((67, 1024), (13, 1100), (40, 4608))
    assert all(quant.many_rows_scheme("q8_0", path, k) == "int16" for _, k in shapes)
    _check_panel_against_micro_kernel("q8_0", path, shapes)
    if path.startswith("avx512"):  # shorter rows keep the fp32 tiles there (quant.Q8_VNNI_PANEL_MIN_K)
        assert quant.many_rows_scheme("q8_0", path, 576) == "fp32"


def test_lookup_formats_on_avx2_take_the_int8_micro_kernel_and_the_fp32_tiles():
    """IQ4_NL's and IQ4_XS's unsigned codes (table value + 128, up to 241) would saturate vpmaddubsw's int16 pair
    sums: on avx2_i8 the micro-kernel multiplies their signed table values by vpsignb'd x instead, per block of
    32 (the int8 scheme); many rows take the fp32 tiles there. On AVX-512 VNNI the unsigned codes with vpdpbusd,
    on the micro-kernel and the panel GEMM."""
    for fmt in ("iq4_nl", "iq4_xs"):
        assert quant.activation_scheme(fmt, "avx2_i8") == "int8"
        assert quant.activation_block(fmt, "avx2_i8") == quant.BLOCK
        assert quant.many_rows_scheme(fmt, "avx2_i8") == "fp32"
        assert quant.tiles_min_rows(fmt, "avx2_i8") == quant.TILES_MIN_ROWS
        assert quant.activation_scheme(fmt, "avx512_vnni_i8") == "int8"
        assert quant.many_rows_scheme(fmt, "avx512_vnni_i8") == "int8"


@pytest.mark.parametrize(("offset", "split"), [(0, False), (8, False), (32, True)])
@pytest.mark.parametrize("op", ["prep_panel", "prep_quad", "prep_quad_avx2"])
def test_rounding_of_x_in_simd_gives_the_scalar_bits(offset, split, op):
    """The AVX-512 roundings of x, the panel GEMM's (prep_row_panel_avx512) and the decode kernel's
    (prep_row_i8_avx512), and the AVX2 one of the decode kernel's (prep_row_i8_avx2), against the portable ones
    they replace: the same int8 codes, scales, sums, lane scales and corrections, bit for bit, over blocks of
    every scale, zeros, ties, subnormals (where 127 / amax is inf and a zero x is nan), the largest floats, infs
    and nans, and a row that is no whole quad of blocks."""
    path = "avx2_i8" if op == "prep_quad_avx2" else "avx512_vnni_i8"
    if path not in INT8_PATHS:
        pytest.skip(f"needs the {path} path")
    assert build.load_quant_ops()
    ops = torch.ops.servelm_quant
    g = torch.Generator().manual_seed(11)
    x = torch.randn(24, 19 * 32, generator=g) * torch.logspace(-40, 38, 24).unsqueeze(1)
    x[0, :32] = 0.0
    x[1] = torch.arange(19 * 32) * 0.5 - 150  # exact halves: ties to even
    x[2, :16], x[2, 16:32] = 1e-40, 0.0  # subnormal amax beside zeros
    x[3, :64] = -0.0
    x[4, 32:64] = 2.0 ** -149
    x[5], x[6, ::2] = 3e38, -3e38
    x[7, 5], x[8, 70], x[9, 100] = float("inf"), float("nan"), -float("inf")
    x[10, :32] = torch.tensor([float("inf"), -float("inf")] * 16)
    if op == "prep_panel":
        scalar, vector = (ops.prep_panel(x, offset, split, v) for v in (False, True))
    else:  # the form of a kernel path: the portable one on the int16 "avx2" path
        scalar, vector = (ops.prep_quad(x, offset, split, quant.isa_index(p)) for p in ("avx2", path))
    for a, b in zip(scalar, vector, strict=True):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b)


# The 16-row layout (quant.interleave_rows16; csrc/rows16_avx512_vnni.cpp, csrc/rows16_avx2.cpp): the int8
# paths' weights in a model, read by one kernel at every M.
ROWS16 = [f for f in quant.ROWS16_FORMATS]
ROWS16_PATHS = [p for p in quant.ROWS16_PATHS if p in INT8_PATHS]
needs_int8 = pytest.mark.skipif(not ROWS16_PATHS, reason="needs AVX2 or AVX-512 VNNI")


def _rows16_weight(fmt: str, n: int, k: int, seed: int) -> quant.QuantWeight:
    return _random_k(fmt, n, k, seed=seed)[1] if fmt in K_QUANTS else _weight(n, k, fmt, seed=seed)[1]


@pytest.mark.parametrize("fmt", ROWS16)
def test_rows16_layout_holds_the_same_bytes(fmt):
    """Interleaving reorders the bytes (the same count), and every reader of rows gets them back: the rows,
    dequantisation, embedding lookups, row and column operations."""
    n, k = 48, 768
    qw = _rows16_weight(fmt, n, k, seed=5)
    il = quant.interleave_rows16(qw)
    assert il.rows16 and not qw.rows16 and il.nbytes == qw.nbytes and il.shape == qw.shape
    back = quant.rows_of(il)
    for a, b in zip(qw.tensors(), back.tensors(), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(quant.dequantize(il), quant.dequantize(qw))
    ids = torch.tensor([[0, 47], [17, 17], [31, 2]])
    assert torch.equal(quant.embedding(ids, il), quant.embedding(ids, qw))
    sub = quant.rows_of(il, torch.tensor([3, 40, 16]))
    assert torch.equal(quant.dequantize(sub), quant.dequantize(qw)[[3, 40, 16]])
    assert torch.equal(quant.dequantize(quant.narrow_rows(il, 16, 20)), quant.dequantize(qw)[16:36])
    fb = quant.block_format(fmt).file_block
    assert torch.equal(quant.dequantize(quant.narrow_cols(il, fb, fb)), quant.dequantize(qw)[:, fb: 2 * fb])
    assert torch.equal(quant.dequantize(quant.cat_rows([il, qw])), torch.cat([quant.dequantize(qw)] * 2))


def test_rows16_takes_whole_groups_of_its_formats():
    assert not quant.rows16_eligible(_weight(40, 64, "q4_1", seed=1)[1])  # 40 rows: not whole groups
    assert not quant.rows16_eligible(_rows16_weight("iq4_nl", 32, 256, seed=1))  # no 16-row kernel for IQ4_NL
    with pytest.raises(ValueError, match="no 16-row layout"):
        quant.interleave_rows16(_weight(40, 64, "q4_1", seed=1)[1])
    qw = _weight(32, 64, "q4_1", seed=1)[1]
    il = quant.interleave_rows16(qw)
    assert not quant.rows16_eligible(il)
    mixed = [qw, il, _weight(40, 64, "q4_1", seed=2)[1], qw]
    assert quant.interleave_in_place(mixed) == 1 and mixed[0].rows16 and not mixed[2].rows16
    storage = {t.untyped_storage().data_ptr() for t in mixed[0].tensors() if t is not None}
    assert len(storage) == 1 and mixed[0].qs.data_ptr() % (2 << 20) == 0  # one huge-page buffer
    assert torch.equal(quant.dequantize(mixed[0]), quant.dequantize(qw))


@pytest.mark.parametrize("fmt", ["q6_k", "q5_0", "q8_0"])
def test_rows16_in_place_by_chunks_of_rows(fmt, monkeypatch):
    """At load a weight is interleaved a chunk of rows at a time into its place in the buffer: the same fields
    as at once."""
    qw = _rows16_weight(fmt, 80, 256, seed=9)
    whole = quant.interleave_rows16(qw)
    monkeypatch.setattr(quant, "_ROWS16_CHUNK", 32)  # chunks of 32, 32 and 16 rows
    assert quant.interleave_in_place([qw]) == 1
    for a, b in zip(qw.tensors(), whole.tensors(), strict=True):
        assert (a is None and b is None) or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


@pytest.mark.parametrize("path", ROWS16_PATHS)
@pytest.mark.parametrize("fmt", ROWS16)
def test_rows16_kernel_matches_the_row_kernel(fmt, path):
    """The same codes of x and exact int32 block products as the AVX-512 VNNI row layout's micro-kernel, summed in
    another fp32 order: within fp32 rounding of it, and within the rounding bound of the exact product; over K not
    a multiple of a quad of blocks (KB = 3, 18), several groups, rows of x in one to many tiles (a verify step's
    5, a prompt's 70; 300 crosses a block of x's rows at K = 4,608), blocks of very different scales, a bias. The
    AVX2 path's row kernel rounds the k-quants' x per 256 (`quant.activation_block`), so there its 16-row kernel
    is held to the AVX-512 VNNI row kernel where the CPU has one, to the exact product alone where not."""
    g = torch.Generator().manual_seed(31)
    row_path = "avx512_vnni_i8" if "avx512_vnni_i8" in INT8_PATHS else path
    compare_rows = quant.activation_block(fmt, row_path) == quant.BLOCK
    try:
        shapes = ((48, 256), (32, 4608)) if fmt in K_QUANTS else ((48, 96), (32, 576), (16, 4608))
        for n, k in shapes:
            qw = _rows16_weight(fmt, n, k, seed=n)
            il = quant.interleave_rows16(qw)
            bias = torch.randn(n, generator=g)
            for m in (1, 2, 3, 4, 5, 6, 7, 13, 70) + ((300,) if k == 4608 else ()):
                x = torch.randn(m, k, generator=g)
                x[0, :32] *= 1000
                x[m // 2, -40:] = 0
                b = bias if m % 2 else None
                quant.force_backend(path)
                y = quant.linear(x, il, b)
                if compare_rows:
                    quant.force_backend(row_path)
                    row = quant.linear(x, qw, b, invariant=True)
                    scale = x.double().abs() @ quant.dequantize(qw).double().abs().T
                    scale = scale + (bias.double().abs() if m % 2 else 0)
                    assert bool(((y.double() - row.double()).abs() <= 2e-6 * scale).all()), (n, k, m)
                quant.force_backend(path)
                _check_close(y, x, qw, b, rows16=True)
    finally:
        quant.force_backend(None)


@pytest.mark.skipif(ROWS16_PATHS != list(quant.ROWS16_PATHS), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("fmt", ROWS16)
def test_rows16_avx2_kernel_is_bitwise_the_avx512_one(fmt):
    """The AVX2 kernel's int16 sums of vpmaddubsw pairs give the exact int32 block products of vpdpbusd, and its
    fp32 steps are the AVX-512 kernel's one for one: the same bits at every M (each tile size, one or both halves
    of a group a pass), with biases, minimums, offsets, scales of very different sizes and codes at their extremes
    (|x| codes of 127 against the largest weight codes: the int16 sums' worst case)."""
    g = torch.Generator().manual_seed(12)
    try:
        for n, k in ((48, 256), (32, 2304)) if fmt in K_QUANTS else ((48, 96), (32, 4608)):
            qw = _rows16_weight(fmt, n, k, seed=n + 1)
            il = quant.interleave_rows16(qw)
            bias = torch.randn(n, generator=g)
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 70):
                x = torch.randn(m, k, generator=g)
                x[0, :32] *= 1000
                x[-1] = x[-1].sign() * 3.0  # every code +-127
                b = bias if m % 2 else None
                quant.force_backend("avx512_vnni_i8")
                ref = quant.linear(x, il, b)
                quant.force_backend("avx2_i8")
                assert torch.equal(quant.linear(x, il, b), ref), (n, k, m)
            # every weight code at its largest (nibbles 15, fifth and high bits set; Q8_0 -128) against x's +127
            top = dataclasses.replace(il, qs=torch.full_like(il.qs, -128 if fmt == "q8_0" else 0xFF),
                                      qh=None if il.qh is None else torch.full_like(il.qh, 0xFF))
            x = torch.full((3, k), 3.0)
            quant.force_backend("avx512_vnni_i8")
            ref = quant.linear(x, top)
            quant.force_backend("avx2_i8")
            assert torch.equal(quant.linear(x, top), ref)
    finally:
        quant.force_backend(None)


AMX = quant.set_amx(None) if "avx512_vnni_i8" in INT8_PATHS else False


@pytest.mark.skipif(not AMX, reason="needs AMX-INT8 (Intel Sapphire Rapids or later)")
@pytest.mark.parametrize("fmt", [f for f in ROWS16 if f not in ("q6_k", "q8_0")])
def test_rows16_amx_kernel_is_bitwise_the_avx512_one(fmt):
    """The AMX tiles' block sums are the exact int32 ones of vpdpbusd and the fp32 steps are the AVX-512 kernel's:
    the same bits at every M (below 12 rows the AVX-512 kernel's own; one tile of 12..16 rows, several tiles of a
    group, whose later tiles read the codes the first one unpacked; 300 rows crossing a block of x's rows at
    K = 4,608), with biases, minimums, offsets, scales of very different sizes and codes at their extremes; one
    and two threads."""
    g = torch.Generator().manual_seed(13)
    threads = torch.get_num_threads()
    try:
        quant.force_backend("avx512_vnni_i8")
        for n, k in ((48, 256), (32, 4608)) if fmt in K_QUANTS else ((48, 96), (32, 4608)):
            qw = _rows16_weight(fmt, n, k, seed=n + 2)
            il = quant.interleave_rows16(qw)
            bias = torch.randn(n, generator=g)
            for m in (5, 12, 13, 16, 17, 40) + ((300,) if k == 4608 else (1100,)):
                x = torch.randn(m, k, generator=g)
                x[0, :32] *= 1000
                x[-1] = x[-1].sign() * 3.0  # every code +-127
                b = bias if m % 2 else None
                for t in (1, 2):
                    torch.set_num_threads(t)
                    assert quant.set_amx(False) is False
                    ref = quant.linear(x, il, b)
                    assert quant.set_amx(True) and quant.amx_in_use()
                    assert torch.equal(quant.linear(x, il, b), ref), (n, k, m, t)
            top = dataclasses.replace(il, qs=torch.full_like(il.qs, 0xFF),
                                      qh=None if il.qh is None else torch.full_like(il.qh, 0xFF))
            x = torch.full((14, k), 3.0)
            quant.set_amx(False)
            ref = quant.linear(x, top)
            quant.set_amx(True)
            assert torch.equal(quant.linear(x, top), ref)
    finally:
        torch.set_num_threads(threads)
        quant.set_amx(None)
        quant.force_backend(None)


def test_amx_switch_and_its_variable(monkeypatch):
    """`set_amx` says what is in use; asking for AMX where the CPU has none, or a bad SERVELM_QUANT_AMX, is a
    one-line error."""
    try:
        assert quant.set_amx(False) is False and not quant.amx_in_use()
        assert quant.set_amx(None) is AMX
        if AMX:
            assert quant.set_amx(True) and quant.amx_in_use()
        else:
            with pytest.raises(ValueError, match="AMX tiles: "):
                quant.set_amx(True)
        monkeypatch.setattr(quant, "_amx_env_done", False)
        monkeypatch.setenv(quant.AMX_ENV, "yes")
        with pytest.raises(ValueError, match="SERVELM_QUANT_AMX='yes': expected 0 or 1"):
            quant._apply_amx_env()
        monkeypatch.setenv(quant.AMX_ENV, "0")
        quant._apply_amx_env()
        assert not quant.amx_in_use()
    finally:
        quant.set_amx(None)


@pytest.mark.parametrize("path", ROWS16_PATHS)
@pytest.mark.parametrize("fmt", ROWS16)
def test_rows16_kernel_is_batch_invariant_at_every_m(fmt, path):
    """One kernel at every M: a row's bits are the same alone, in any batch (a prompt's many rows included), through
    `linear` and `linear_tiles`, deterministic mode or not, with 1 or 2 threads; a nan or inf in one row of x
    reaches only that row's outputs."""
    g = torch.Generator().manual_seed(6)
    quant.force_backend(path)
    threads = torch.get_num_threads()
    try:
        k = 512 if fmt in K_QUANTS else 576
        il = quant.interleave_rows16(_rows16_weight(fmt, 64, k, seed=4))
        bias = torch.randn(64, generator=g)
        x = torch.randn(80, k, generator=g)
        full = quant.linear(x, il, bias)
        assert torch.equal(quant.linear(x, il, bias, invariant=True), full)
        tiles = torch.ops.servelm_quant.linear_tiles.default(x, *il.tensors(), quant.block_format(fmt).code, bias,
                                                               quant.isa_index())
        assert torch.equal(tiles, full)
        torch.set_num_threads(1)
        for rows in (slice(0, 1), slice(5, 10), slice(36, 37), slice(3, 80)):
            assert torch.equal(quant.linear(x[rows], il, bias), full[rows])
        torch.set_num_threads(threads)
        bad = x[:3].clone()
        bad[1, 7] = float("nan")
        bad[2, 100] = float("inf")
        y = quant.linear(bad, il, bias)
        assert torch.equal(y[0], full[0]) and bool(y[1].isnan().all()) and not bool(y[2].isfinite().any())
    finally:
        torch.set_num_threads(threads)
        quant.force_backend(None)


@needs_int8
def test_rows16_weights_need_an_int8_path():
    il = quant.interleave_rows16(_weight(32, 64, "q4_0", seed=1)[1])
    x = torch.randn(2, 64)
    for other in [p for p in ("avx2", "avx512_vnni") if p in KERNELS]:  # another scheme is never computed on it
        with pytest.raises(RuntimeError, match="interleaved by 16 rows need the avx512_vnni_i8 or avx2_i8 path"):
            torch.ops.servelm_quant.linear.default(x, *il.tensors(), quant.block_format("q4_0").code, None,
                                                   quant.isa_index(other))
    with pytest.raises(RuntimeError, match="qs layout"):
        torch.ops.servelm_quant.linear.default(x, il.qs[:, :, :2].contiguous(), *il.tensors()[1:],
                                               quant.block_format("q4_0").code, None, quant.isa_index(ROWS16_PATHS[0]))
