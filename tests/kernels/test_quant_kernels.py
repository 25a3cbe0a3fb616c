"""servelm.kernels.quant: the C++ kernel (each ISA this CPU has, and the scalar path) and the torch fallback
against a plain dequantise-then-matmul reference; ggml block compatibility; batch invariance; row/column ops."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from servelm.kernels import build, quant

GGML = {fmt: quant.block_format(fmt).ggml for fmt in quant.FORMATS}
ISAS = ("scalar", "avx2", "avx512", "avx512_vnni")


def _kernel_paths() -> list[str]:
    best = quant.force_backend(None)
    return ["torch"] if best == "torch" else list(ISAS[: ISAS.index(best) + 1])


PATHS = _kernel_paths() + (["torch"] if _kernel_paths() != ["torch"] else [])
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


def _code_step(x: torch.Tensor) -> torch.Tensor:
    """Per element of x, the step of the kernel's int16 codes: 2^(e - 15) for its block's max |x| = f * 2^e."""
    k = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -k % quant.BLOCK)).unflatten(-1, (-1, quant.BLOCK))
    _, e = torch.frexp(blocks.abs().amax(-1, keepdim=True))
    return torch.ldexp(torch.ones(()), (e - 15).double()).expand_as(blocks).flatten(-2)[..., :k]


def _check_close(y: torch.Tensor, x: torch.Tensor, qw: quant.QuantWeight, bias: torch.Tensor | None) -> None:
    w = quant.dequantize(qw).double()
    ref = x.double() @ w.T + (bias.double() if bias is not None else 0)
    bound = (x.double().abs() @ w.abs().T) * 2e-6 + 1e-6  # fp32 rounding of a K-term sum, generously
    if quant.kernel_backend() != "torch":  # x rounded to int16 codes: at most half a step per element
        bound = bound + (_code_step(x.double()) / 2) @ w.abs().T
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert bool(((y.double() - ref).abs() <= bound).all()), float((y.double() - ref).abs().max())


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_linear_matches_dequantised_matmul(path, fmt):
    g = torch.Generator().manual_seed(1)
    for n, k in ((67, 70), (131, 96), (13, 575)):  # N odd, K not a multiple of 32 (padded by quantize)
        _, qw = _weight(n, k, fmt, seed=n)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 5, 6, 7, 13, 37, 70):
            x = torch.randn(m, k, generator=g)
            _check_close(quant.linear(x, qw, bias if m % 2 else None), x, qw, bias if m % 2 else None)
    x3 = torch.randn(2, 3, 70, generator=g)  # leading dims kept
    assert quant.linear(x3, _weight(67, 70, fmt)[1]).shape == (2, 3, 67)


@pytest.mark.parametrize("path", KERNELS, indirect=True)
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_kernel_dequantises_exactly(path, fmt):
    """x = identity: each output is one weight times 1 plus zeros, so the kernel's own dequantised values show."""
    _, qw = _weight(77, 70, fmt, seed=3)
    for invariant in (False, True):  # the fp32 tile path (70 rows) and the int16 scheme
        y = quant.linear(torch.eye(70), qw, invariant=invariant)
        assert torch.equal(y, quant.dequantize(qw).T)
    for row in (0, 33, 69):  # one row: the int16 scheme either way
        assert torch.equal(quant.linear(torch.eye(70)[row: row + 1], qw), quant.dequantize(qw).T[row: row + 1])


@pytest.mark.parametrize("path", KERNELS, indirect=True)
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_linear_is_batch_invariant(path, fmt):
    """With invariant=True (deterministic mode), row m is bitwise the same alone, in a batch of 37 with other
    rows, and with 1 or 2 threads. Without it, 10+ rows take the fp32 tile path: close, not the same bits."""
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
        tiles = quant.linear(x, qw, bias)
        assert not torch.equal(tiles, full)
        torch.testing.assert_close(tiles, full, rtol=1e-3, atol=2e-3)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("avx512_vnni" not in KERNELS, reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_vnni_and_plain_avx512_give_the_same_bits(fmt):
    """Both compute the same exact int32 block sums (vpdpwssd vs vpmaddwd + vpaddd), then the same fp32 steps."""
    g = torch.Generator().manual_seed(5)
    _, qw = _weight(75, 600, fmt, seed=6)
    x = torch.randn(9, 600, generator=g)
    try:
        outs = [quant.force_backend(isa) and quant.linear(x, qw) for isa in ("avx512", "avx512_vnni")]
    finally:
        quant.force_backend(None)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("path", KERNELS, indirect=True)
def test_nan_and_inf_in_x_propagate(path):
    _, qw = _weight(40, 96, "q4_1", seed=7)
    x = torch.randn(3, 96)
    x[0, 5], x[1, 70] = float("nan"), float("inf")
    y = quant.linear(x, qw)
    assert bool(y[:2].isnan().all()) and bool(y[2].isfinite().all())


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_quantize_is_ggml_reference_and_round_trips_blocks(fmt):
    w, qw = _weight(9, 70, fmt)
    padded = torch.nn.functional.pad(w, (0, 26)).numpy()
    assert np.array_equal(quant.to_gguf(qw), gguf_quantize(padded, GGML[fmt]))
    expected = gguf_dequantize(quant.to_gguf(qw), GGML[fmt])[:, :70]
    assert np.array_equal(quant.dequantize(qw).numpy(), expected)
    again = quant.from_gguf(quant.to_gguf(qw), fmt, (9, 70))
    assert torch.equal(again.qs, qw.qs) and torch.equal(again.d, qw.d)
    assert qw.nbytes == 9 * 3 * quant.bytes_per_block(fmt)


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
        quant.quantize(torch.zeros(2, 32), "q5_k")
    with pytest.raises(ValueError, match="bytes per row"):
        quant.from_gguf(np.zeros((8, 39), np.uint8), "q4_1", (8, 64))
    with pytest.raises(ValueError, match="features"):
        quant.linear(torch.zeros(1, 63), qw)
    with pytest.raises(ValueError, match="multiples of 32"):
        quant.narrow_cols(qw, 16, 32)
    with pytest.raises(ValueError, match="outside"):
        quant.narrow_rows(qw, 4, 5)


@pytest.mark.parametrize("fmt", quant.FORMATS)
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
    x = torch.randn(4, 100)
    split = quant.linear(x[:, :64], left) + quant.linear(x[:, 64:], right)  # row-parallel TP: partial sums
    torch.testing.assert_close(split, quant.linear(x, qw), rtol=1e-5, atol=1e-5)
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


def _random_q4_k(n: int, k: int, d: np.ndarray, dmin: np.ndarray, seed: int) -> np.ndarray:
    """Random Q4_K super-blocks (any 6-bit scales/mins and nibbles are valid) with the given fp16 d/dmin."""
    blocks = np.random.default_rng(seed).integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    blocks[:, 2:4] = dmin.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks.reshape(n, -1)


def test_q4_k_repacks_as_q4_1_exactly_when_the_scales_fit_fp16():
    """d = 2^-10, dmin = 2^-8: d * scale and dmin * min are exact in fp16, so the q4_1 blocks dequantise to
    gguf's own Q4_K values bit for bit (which checks the nibble and scale layouts)."""
    n, k = 7, 768
    raw = _random_q4_k(n, k, np.full(n * 3, 2.0 ** -10), np.full(n * 3, 2.0 ** -8), seed=8)
    qw = quant.from_gguf_k(raw, "q4_k", (n, k))
    assert qw.fmt == "q4_1" and qw.shape == (n, k) and qw.nbytes == n * k // 32 * 20
    expected = gguf_dequantize(raw, GGMLQuantizationType.Q4_K).reshape(n, k)
    assert np.array_equal(quant.dequantize(qw).numpy(), expected)


def test_q4_k_whose_scales_overflow_fp16_is_not_repacked():
    raw = _random_q4_k(2, 256, np.full(2, 60000.0), np.full(2, 1.0), seed=12)  # 60000 x a 6-bit scale > fp16
    assert quant.from_gguf_k(raw, "q4_k", (2, 256)) is None  # the loader dequantises it to fp32 instead


def test_q4_k_repack_rounds_only_the_sub_block_scales():
    from gguf.quants import Q4_K

    n, k = 4, 512
    rng = np.random.default_rng(9)
    raw = _random_q4_k(n, k, rng.uniform(1e-4, 1e-2, n * 2), rng.uniform(1e-4, 1e-2, n * 2), seed=10)
    got = quant.dequantize(quant.from_gguf_k(raw, "q4_k", (n, k))).numpy().reshape(-1, 8, 32)
    expected = gguf_dequantize(raw, GGMLQuantizationType.Q4_K).reshape(-1, 8, 32)
    blocks = raw.reshape(-1, 144)
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    bound = (2.0 ** -11 * (15 * d * sc + dmin * mins) * 1.001)[..., None]  # fp16 rounding of both products
    assert bool((np.abs(got - expected) <= bound).all())
    assert not np.array_equal(got, expected)  # these scales do not all fit fp16


def test_q6_k_requantises_to_q8_0():
    from tests.models.gguf_files import quantize_k

    w = torch.randn(5, 512, generator=torch.Generator().manual_seed(11)).numpy()
    raw = quantize_k(w, "Q6_K")
    qw = quant.from_gguf_k(raw, "q6_k", (5, 512))
    assert qw.fmt == "q8_0" and qw.shape == (5, 512)
    src = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(5, -1, 32)
    got = quant.dequantize(qw).numpy().reshape(5, -1, 32)
    step = np.abs(src).max(-1, keepdims=True) / 127
    # ggml's Q8_0: codes rounded against the fp32 step (half a step), decoded with its fp16 rounding (up to 127
    # codes x 2^-11 of a step more)
    assert bool((np.abs(got - src) <= step * (0.5 + 127 * 2.0 ** -11) * 1.001 + 1e-7).all())
    with pytest.raises(ValueError, match="k-quant"):
        quant.from_gguf_k(raw, "q5_k", (5, 512))
