"""KV-cache storage dtypes (`--kv-cache-dtype`, servelm.mem_cache.memory_pool) and the decode attention that
reads them in place (servelm_fused.decode_attention, flash-decoding over fixed chunks of keys):

* the C++ encoding gives torch's bits (memory_pool.encode) on every ISA, and decoding is exact;
* decode attention over every dtype against float64 attention over the decoded K/V, for contexts of 1 to 20k
  keys across chunk boundaries, in batches, and through the layer's torch path;
* its bits depend neither on the thread count nor on the other requests of the step;
* over a bf16 cache on an AVX512_BF16 CPU (ISA level avx512_bf16) its products are bf16 (the query and the
  probabilities rounded to bf16, sums in fp32): checked against float64 attention that rounds the same values.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from servelm.layers import fused
from servelm.layers.attention import PagedAttention
from servelm.layers.rotary import RotaryEmbedding
from servelm.mem_cache import memory_pool as mp
from servelm.mem_cache.memory_pool import KVCache
from servelm.model_executor.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(not fused.loaded(), reason="the C++ kernels cannot be built here")

STORED = [d for d in mp.KV_CACHE_DTYPES if d != "auto"]
CHUNK = 128  # kAttnChunk in fused_ops.cpp
BF16_PRODUCTS = 3  # servelm_fused's ISA level avx512_bf16 (fused_ops.cpp kAvx512Bf16)


def _bf16_products(name: str, isa: int | None = None) -> bool:
    """Whether decode attention over a `name` cache takes bf16 products on ISA level `isa` (default: the best,
    which the ops use unless a test sets another)."""
    level = torch.ops.servelm_fused.best_isa() if isa is None else isa
    return name == "bfloat16" and level >= BF16_PRODUCTS


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _values(seed: int = 0) -> torch.Tensor:
    """Rows spanning 1e-12 .. 1e6 in magnitude (subnormals of every format, saturation), zeros, ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 64, generator=g) * torch.logspace(-12, 6, 300).unsqueeze(1)
    x[0] = 0.0
    x[1, :8] = torch.tensor([448.1, -448.0, 65504.0, 65519.0, 1e-40, -0.0, 57344.0, 1e9])
    x[2] = torch.arange(64) * 0.5 - 16  # exact halves: round-to-even ties in int8 and the fp8 formats
    return torch.cat([x, torch.randn(5, 64, generator=g) * 1e-5, torch.randn(3, 40, generator=g).repeat(1, 2)[:, :64]])


@pytest.mark.parametrize("name", STORED)
def test_cpp_encoding_gives_torch_bits(isa: int, name: str) -> None:
    x = _values()
    dtype = mp.storage_dtype(name)
    ref, ref_scale = mp.encode(x, dtype)
    got, scale = fused.kv_encode(x, dtype)
    assert torch.equal(_bits(got), _bits(ref))
    if ref_scale is not None:
        assert torch.equal(_bits(scale), _bits(ref_scale))
    # a row whose length is no multiple of the vector width: its tail gets the same bits
    odd = x[:, :37].contiguous()
    assert torch.equal(_bits(fused.kv_encode(odd, dtype)[0]), _bits(mp.encode(odd, dtype)[0]))


# (dtype, bound on |decoded - x| / |x| for values well inside its normal range)
RELATIVE = {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}


@pytest.mark.parametrize("name", STORED)
def test_decoding_is_exact_and_errors_bounded(name: str) -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 3
    values, scale = mp.encode(x, mp.storage_dtype(name))
    out = mp.decode(values, scale, torch.float32)
    assert torch.equal(mp.encode(out, mp.storage_dtype(name))[0].view(torch.uint8),
                       values.view(torch.uint8))  # decoded values encode to themselves
    if name == "int8":
        step = scale.float().unsqueeze(-1)
        assert ((out - x).abs() <= step * 0.5 * (1 + 1e-3) + 1e-7).all()
        assert (values.abs() <= 127).all()
    else:
        big = x.abs() > 0.05
        assert ((out - x).abs()[big] <= RELATIVE[name] * x.abs()[big] * (1 + 1e-6)).all()


def test_encoding_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([[1e9, -1e9, 70000.0, 500.0, 0.0, 1.0]])
    for name, top in (("float16", 65504.0), ("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        out = mp.decode(*mp.encode(x, mp.storage_dtype(name)), torch.float32)[0]
        assert torch.isfinite(out).all() and out[0] == top and out[1] == -top
    codes, scale = mp.encode(torch.zeros(2, 64), torch.int8)  # an all-zero head: scale 0, codes 0, no NaN
    assert (codes == 0).all() and (scale == 0).all()
    assert (mp.decode(codes, scale, torch.float32) == 0).all()


def _case(name: str, lens: list[int], hkv: int, group: int, D: int, seed: int, slots_total: int | None = None):
    """A cache of `name` filled with random K/V, each request's slots a random permutation."""
    g = torch.Generator().manual_seed(seed)
    total = slots_total or max(4096, sum(lens) + 8)
    cache = KVCache(1, total, hkv, D, torch.float32, torch.device("cpu"), name)
    kv = cache.layer(0)
    kv.write(torch.arange(total), torch.randn(total, hkv, D, generator=g), torch.randn(total, hkv, D, generator=g))
    perm = torch.randperm(total, generator=g)
    slots, start = [], 0
    for n in lens:
        slots.append(perm[start:start + n])
        start += n
    q = torch.randn(len(lens), hkv * group, D, generator=g)
    index = torch.stack([F.pad(s, (0, max(lens) - len(s)), value=int(s[0])) for s in slots])
    return cache, kv, slots, q, index, torch.tensor(lens)


def _reference(kv: mp.LayerKV, q: torch.Tensor, slots: list[torch.Tensor], group: int) -> torch.Tensor:
    """float64 attention of each request's query over its decoded K/V."""
    outs = []
    for b, s in enumerate(slots):
        keys, values = (t.double().repeat_interleave(group, dim=1) for t in kv.gather(s))  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[b].double(), keys) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values).reshape(-1))
    return torch.stack(outs).float()


def _reference_bf16_products(kv: mp.LayerKV, q: torch.Tensor, slots: list[torch.Tensor], group: int,
                             scale: float) -> torch.Tensor:
    """float64 attention rounding what the bf16-product kernel rounds: each query to bf16; per chunk of CHUNK
    keys (from position 0), the probabilities exp(s - the chunk's max) to bf16 where they weigh V (not in the
    sums they are divided by); the chunks merged by their maxima."""
    outs = []
    for b, s in enumerate(slots):
        keys, values = (t.double().repeat_interleave(group, dim=1) for t in kv.gather(s))  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[b].bfloat16().double(), keys) * scale
        maxima, sums, accs = [], [], []
        for c in range(0, scores.shape[1], CHUNK):
            m = scores[:, c:c + CHUNK].amax(-1, keepdim=True)
            e = (scores[:, c:c + CHUNK] - m).exp()
            maxima.append(m)
            sums.append(e.sum(-1, keepdim=True))
            accs.append(torch.einsum("hl,lhd->hd", e.float().bfloat16().double(), values[c:c + CHUNK]))
        top = torch.stack(maxima).amax(0)
        w = [(m - top).exp() for m in maxima]
        out = sum(wc * a for wc, a in zip(w, accs)) / sum(wc * sc for wc, sc in zip(w, sums))
        outs.append(out.reshape(-1))
    return torch.stack(outs).float()


@pytest.mark.parametrize("name", STORED)
@pytest.mark.parametrize(("group", "D"), [(1, 64), (4, 64), (3, 128), (2, 40)])
def test_decode_attention_reads_every_dtype(isa: int, name: str, group: int, D: int) -> None:
    lens = [1, 5, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3, 700]
    cache, kv, slots, q, index, lens_t = _case(name, lens, 2, group, D, seed=group * D)
    out = fused.decode_attention(q, kv, index, lens_t, D ** -0.5)
    if _bf16_products(name, isa) and D % 32 == 0:
        # the rounded values as the kernel rounds them; a probability that fp32 and float64 put on either side
        # of a bf16 rounding boundary is one ulp apart (2^-8 of it), hence the 2e-4 (the query's rounding
        # alone is ~1e-3 here)
        torch.testing.assert_close(out, _reference_bf16_products(kv, q, slots, group, D ** -0.5), rtol=1e-4,
                                   atol=2e-4)
        assert (out - _reference(kv, q, slots, group)).abs().max() > 1e-4  # it did round
    else:
        torch.testing.assert_close(out, _reference(kv, q, slots, group), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8"])
def test_decode_attention_long_contexts(name: str) -> None:
    """Up to 20k keys for one request and one KV head (a context split over every thread) against SDPA."""
    lens = [20000, 4097, 3]
    cache, kv, slots, q, index, lens_t = _case(name, lens, 1, 4, 64, seed=5)
    out = fused.decode_attention(q, kv, index, lens_t, 0.125)
    if _bf16_products(name):
        torch.testing.assert_close(out, _reference_bf16_products(kv, q, slots, 4, 0.125), rtol=1e-4, atol=2e-4)
        return
    for b, s in enumerate(slots):
        keys, values = kv.gather(s)  # [L, 1, D]
        ref = F.scaled_dot_product_attention(q[b].view(1, 4, 1, 64), keys.transpose(0, 1).unsqueeze(0),
                                             values.transpose(0, 1).unsqueeze(0), scale=0.125, enable_gqa=True)
        torch.testing.assert_close(out[b], ref.reshape(-1), rtol=2e-5, atol=2e-5)


def test_decode_attention_bits_ignore_threads_and_batch() -> None:
    """Fixed chunks merged in order: a request's output has the same bits on 1 or 2 threads, alone or batched."""
    lens = [3000, 17, 300, 129]
    cache, kv, slots, q, index, lens_t = _case("bfloat16", lens, 2, 4, 64, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused.decode_attention(q, kv, index, lens_t, 0.125)
        torch.set_num_threads(2)
        two = fused.decode_attention(q, kv, index, lens_t, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for b in range(len(lens)):
        alone = fused.decode_attention(q[b:b + 1], kv, index[b:b + 1, :lens[b]].contiguous(), lens_t[b:b + 1], 0.125)
        assert torch.equal(alone[0], two[b])


@pytest.mark.parametrize("name", STORED)
@pytest.mark.parametrize(("group", "D"), [(3, 64), (2, 40), (32, 64)])
def test_verify_rows_share_their_keys_and_keep_their_bits(isa: int, name: str, group: int, D: int) -> None:
    """A speculating request's verify rows (the same slots, each row one key more) are attended to together, a
    chunk's keys read once for all of them; every row gets the bits it gets alone, across chunk boundaries
    and beside other requests (and a run longer than one unit takes, 16 rows; with 32 query heads a KV head,
    more (row, query head) pairs than the bf16 products convert at once)."""
    cache, kv, slots, q, index, lens_t = _case(name, [CHUNK - 2, 40, 2 * CHUNK + 3], 3, group, D, seed=D)
    rows = [(0, 5), (1, 1), (2, 20)]  # (request, verify rows): rows see its first n - 1 + j keys and then more
    extra = torch.randperm(4096, generator=torch.Generator().manual_seed(D))[:24]
    q_rows, idx_rows, lens = [], [], []
    for r, k in rows:
        base = torch.cat([slots[r], extra])
        for j in range(k):
            q_rows.append(q[r] * (1 + j))
            idx_rows.append(base[: len(slots[r]) + j])
            lens.append(len(slots[r]) + j)
    width = max(lens)
    index = torch.stack([F.pad(s, (0, width - len(s)), value=int(s[0])) for s in idx_rows])
    qs, lens_t = torch.stack(q_rows), torch.tensor(lens)
    together = fused.decode_attention(qs, kv, index, lens_t, D ** -0.5)
    for b in range(len(lens)):
        alone = fused.decode_attention(qs[b:b + 1], kv, index[b:b + 1, :lens[b]].contiguous(), lens_t[b:b + 1],
                                       D ** -0.5)
        assert torch.equal(alone[0], together[b]), b


@pytest.mark.parametrize("name", STORED)
def test_qkv_rotary_cache_writes_the_encoded_kv(name: str) -> None:
    H, Hkv, D, T = 8, 2, 64, 9
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), D, 2048)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 4
    positions = torch.randint(0, 2048, (T,), generator=g)
    loc = torch.randperm(100, generator=g)[:T]
    fused_cache = KVCache(1, 100, Hkv, D, torch.float32, torch.device("cpu"), name)
    torch_cache = KVCache(1, 100, Hkv, D, torch.float32, torch.device("cpu"), name)
    for c in (fused_cache, torch_cache):
        for t in (c.k, c.v, c.k_scale, c.v_scale):
            if t is not None:
                t.view(torch.uint8).zero_()
    q = fused.qkv_rotary_cache(qkv, positions, rope.cos, rope.sin, fused_cache.layer(0), loc, H)
    q_ref, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    previous = fused.set_enabled(False)
    try:
        q_ref, k_ref = rope(positions, q_ref.reshape(T, H, D), k.reshape(T, Hkv, D))
    finally:
        fused.set_enabled(previous)
    torch_cache.layer(0).write(loc, k_ref, v.reshape(T, Hkv, D))
    assert torch.equal(q, q_ref)
    assert torch.equal(_bits(fused_cache.k), _bits(torch_cache.k)) and torch.equal(_bits(fused_cache.v),
                                                                                     _bits(torch_cache.v))
    if name == "int8":
        assert torch.equal(_bits(fused_cache.k_scale), _bits(torch_cache.k_scale))
        assert torch.equal(_bits(fused_cache.v_scale), _bits(torch_cache.v_scale))


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e5m2", "int8"])
def test_layer_fused_and_torch_paths_agree(name: str) -> None:
    """PagedAttention over a mixed step (decodes beside a prefill and an extend) with the cache in `name`:
    the fused decode and the torch code (gather, decode, SDPA / matmuls) agree."""
    extend = [1, 9, 1, 5, 1]
    lens = [40, 9, 300, 20, 130]
    cache, kv, slots, _, _, _ = _case(name, lens, 3, 3, 64, seed=11)
    q = torch.randn(sum(extend), 9, 64, generator=torch.Generator().manual_seed(12))
    attn = PagedAttention(9, 3, 64, layer_id=0)
    pos, out_loc = [], []
    for n, s in zip(extend, slots):
        pos += list(range(len(s) - n, len(s)))
        out_loc += s[len(s) - n:].tolist()
    fb = ForwardBatch.build([0] * len(pos), pos, out_loc, extend, [s.tolist() for s in slots], [len(pos) - 1],
                            torch.device("cpu"))
    fb.kv_cache = cache
    k, v = kv.gather(fb.out_cache_loc)  # rewriting decoded values leaves the cache's bits as they are
    out = attn(q, k, v, fb)
    previous = fused.set_enabled(False)
    try:
        ref = attn(q, k, v, fb)
    finally:
        fused.set_enabled(previous)
    if _bf16_products(name):  # the decode rows' query and probabilities rounded to bf16 (the torch path's are not)
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=4e-3)
        assert (out - ref).abs().max() > 1e-5
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_pool_sizes_and_auto() -> None:
    per = {name: KVCache.bytes_per_token(30, 3, 64, name) for name in STORED}
    assert per["float32"] == 2 * per["bfloat16"] == 2 * per["float16"] == 4 * per["fp8_e4m3"]
    assert per["float32"] / per["int8"] == pytest.approx(4 * 64 / 66)  # int8 codes + a float16 scale per head
    cpu = torch.device("cpu")
    assert mp.resolve_kv_dtype("auto", torch.float32, cpu, deterministic=True) == "float32"
    assert mp.resolve_kv_dtype("auto", torch.bfloat16, cpu, deterministic=False) == "bfloat16"
    expected = "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float16"
    assert mp.resolve_kv_dtype("auto", torch.float32, cpu, deterministic=False) == expected
    assert mp.resolve_kv_dtype("int8", torch.float32, cpu, deterministic=True) == "int8"
    with pytest.raises(ValueError, match="is not one of"):
        mp.resolve_kv_dtype("fp4", torch.float32, cpu, deterministic=False)
    assert math.isclose(KVCache(1, 8, 1, 64, torch.float32, cpu, "int8").describe()["kv_cache_bytes_per_token"], 132)
