"""servelm_fused.prefill_attention: the blocked causal attention of prefill and extend steps over the paged KV,
read in its storage dtype (online softmax over fixed 128-key chunks, no [q, k] matrix):

* every ISA and KV dtype against float64 attention over the decoded K/V, prompts and extends across chunk
  boundaries, several requests in one call, head groups of 1 to 7 and head sizes 40 to 128;
* long contexts (20k keys) against SDPA;
* not causal (an encoder's attention: every query sees all its request's keys), every ISA and KV dtype;
* a row's bits depend neither on the threads, nor on the other requests, nor on how its prompt was chunked;
* through PagedAttention in mixed steps against the layer's torch path (SDPA);
* over a bf16 cache on an AVX512_BF16 CPU (ISA level avx512_bf16) its products are bf16 (the scaled query and
  the probabilities rounded to bf16): against float64 attention that rounds the same values;
* bad inputs are refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.layers import fused
from servelm.layers.attention import PagedAttention
from servelm.mem_cache import memory_pool as mp
from servelm.mem_cache.memory_pool import KVCache
from tests.layers.test_fused_ops import _forward
from tests.layers.test_kv_cache_dtypes import _bf16_products

pytestmark = pytest.mark.skipif(not fused.loaded(), reason="the C++ kernels cannot be built here")

STORED = [d for d in mp.KV_CACHE_DTYPES if d != "auto"]
CHUNK = 128  # kAttnChunk in fused_ops.cpp


def _case(name: str, reqs: list[tuple[int, int]], hkv: int, group: int, D: int, seed: int):
    """A cache of `name` with random K/V; request r has seq_len reqs[r][0] keys (random slots), of which the
    last reqs[r][1] are its new queries. Returns (kv, slot lists, q [T, H, D], index, reqs tensor)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(L for L, _ in reqs) + 8
    cache = KVCache(1, total, hkv, D, torch.float32, torch.device("cpu"), name)
    kv = cache.layer(0)
    kv.write(torch.arange(total), torch.randn(total, hkv, D, generator=g), torch.randn(total, hkv, D, generator=g))
    perm = torch.randperm(total, generator=g)
    slots, rows, start, qs = [], [], 0, 0
    for L, n in reqs:
        slots.append(perm[start:start + L])
        rows.append((qs, n, L, start))
        start += L
        qs += n
    q = torch.randn(qs, hkv * group, D, generator=g)
    return kv, slots, q, torch.cat(slots), torch.tensor(rows, dtype=torch.long).view(-1, 4)


def _run(q: torch.Tensor, kv: mp.LayerKV, index: torch.Tensor, reqs: torch.Tensor,
         causal: bool = True) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"))
    fused.prefill_attention(q, kv, index, reqs, q.shape[-1] ** -0.5, out, causal=causal)
    return out


def _reference(kv: mp.LayerKV, q: torch.Tensor, slots: list[torch.Tensor], reqs: torch.Tensor,
               group: int, causal: bool = True) -> torch.Tensor:
    """float64 attention (causal, or over all keys) of each request's queries over its decoded K/V."""
    outs = []
    for s, (qs, n, L, _) in zip(slots, reqs.tolist()):
        keys, values = (t.double().repeat_interleave(group, dim=1) for t in kv.gather(s))  # [L, H, D]
        scores = torch.einsum("ihd,lhd->hil", q[qs:qs + n].double(), keys) * q.shape[-1] ** -0.5
        visible = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]  # [n, L]
        if causal:
            scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hil,lhd->ihd", scores.softmax(-1), values).reshape(n, -1))
    return torch.cat(outs).float()


def _reference_bf16_products(kv: mp.LayerKV, q: torch.Tensor, slots: list[torch.Tensor], reqs: torch.Tensor,
                             group: int, causal: bool = True) -> torch.Tensor:
    """float64 attention rounding what the bf16-product kernel rounds: each query times the scale (in fp32) to
    bf16; the online softmax over chunks of CHUNK keys (from position 0), each chunk's exp(s - the running max)
    rounded to bf16 where it weighs V (not in the sums divided by)."""
    outs = []
    for s, (qs, n, L, _) in zip(slots, reqs.tolist()):
        keys, values = (t.double().repeat_interleave(group, dim=1) for t in kv.gather(s))  # [L, H, D]
        scores = torch.einsum("ihd,lhd->hil", (q[qs:qs + n] * q.shape[-1] ** -0.5).bfloat16().double(), keys)
        if causal:
            visible = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        top = torch.full(scores.shape[:2] + (1,), float("-inf"), dtype=torch.float64)
        acc, total = 0.0, 0.0
        for c in range(0, L, CHUNK):
            chunk = scores[..., c:c + CHUNK]
            new_top = torch.maximum(top, chunk.amax(-1, keepdim=True))
            alpha, e = (top - new_top).exp(), (chunk - new_top).exp()
            acc = acc * alpha + torch.einsum("hil,lhd->hid", e.float().bfloat16().double(), values[c:c + CHUNK])
            total = total * alpha + e.sum(-1, keepdim=True)
            top = new_top
        outs.append((acc / total).transpose(0, 1).reshape(n, -1))
    return torch.cat(outs).float()


def _check(out: torch.Tensor, kv: mp.LayerKV, q: torch.Tensor, slots: list[torch.Tensor], reqs: torch.Tensor,
           group: int, name: str, isa: int | None = None, causal: bool = True) -> None:
    """`out` against float64 attention, or where the kernel takes bf16 products against the reference that
    rounds the same values (a probability that fp32 and float64 put on either side of a bf16 rounding boundary
    is one ulp apart: up to ~3e-4 here, hence 5e-4; rounding the query alone moves the output by ~3e-3)."""
    if _bf16_products(name, isa) and q.shape[-1] % 32 == 0 and q.shape[-1] >= CHUNK // 2:
        ref = _reference_bf16_products(kv, q, slots, reqs, group, causal)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=5e-4)
        assert (out - _reference(kv, q, slots, reqs, group, causal)).abs().max() > 1e-4  # it did round
    else:
        torch.testing.assert_close(out, _reference(kv, q, slots, reqs, group, causal), rtol=1e-5, atol=1e-5)


# (seq_len, new tokens): whole prompts and extends after a cached prefix, on and across chunk boundaries
REQS = [(2, 2), (5, 3), (CHUNK - 1, CHUNK - 1), (CHUNK + 1, CHUNK + 1), (300, 40), (2 * CHUNK + 3, 1),
        (CHUNK + 7, 9)]


@pytest.mark.parametrize("name", STORED)
@pytest.mark.parametrize(("group", "D"), [(1, 64), (4, 64), (3, 128), (7, 64), (2, 40)])
def test_prefill_attention_reads_every_dtype(isa: int, name: str, group: int, D: int) -> None:
    kv, slots, q, index, reqs = _case(name, REQS, 2, group, D, seed=group * D)
    _check(_run(q, kv, index, reqs), kv, q, slots, reqs, group, name, isa)


@pytest.mark.parametrize("name", STORED)
@pytest.mark.parametrize(("group", "D"), [(1, 32), (4, 64), (3, 40)])
def test_prefill_attention_not_causal(isa: int, name: str, group: int, D: int) -> None:
    """An encoder's attention (BertLayer): every query sees every key of its request, across chunk boundaries."""
    kv, slots, q, index, reqs = _case(name, REQS, 2, group, D, seed=group * D + 1)
    out = _run(q, kv, index, reqs, causal=False)
    _check(out, kv, q, slots, reqs, group, name, isa, causal=False)
    assert not torch.allclose(out, _run(q, kv, index, reqs))  # the mask is what differs


def test_prefill_attention_writes_only_its_rows() -> None:
    kv, slots, q, index, reqs = _case("bfloat16", [(40, 10), (20, 5)], 1, 3, 64, seed=2)
    reqs = reqs[1:]  # only the second request: rows 10 .. 14
    out = _run(q, kv, index, reqs)
    assert torch.isnan(out[:10]).all() and torch.isfinite(out[10:]).all()
    reqs[:, 0] = 0  # the reference takes the request's rows from the start of q
    _check(out[10:], kv, q[10:], slots[1:], reqs, 3, "bfloat16")


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8"])
def test_prefill_attention_long_contexts(name: str) -> None:
    """The last 64 queries of a 20k-token prompt and a whole 1k prompt, against SDPA over the decoded K/V."""
    reqs_list = [(20000, 64), (1000, 1000)]
    kv, slots, q, index, reqs = _case(name, reqs_list, 2, 4, 64, seed=5)
    out = _run(q, kv, index, reqs)
    if _bf16_products(name):
        torch.testing.assert_close(out, _reference_bf16_products(kv, q, slots, reqs, 4), rtol=1e-4, atol=5e-4)
        return
    for s, (qs, n, L, _) in zip(slots, reqs.tolist()):
        keys, values = kv.gather(s)
        mask = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
        ref = F.scaled_dot_product_attention(q[qs:qs + n].transpose(0, 1).unsqueeze(0),
                                             keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
                                             attn_mask=mask, scale=0.125, enable_gqa=True)
        torch.testing.assert_close(out[qs:qs + n], ref[0].transpose(0, 1).reshape(n, -1), rtol=2e-5, atol=2e-5)


def test_prefill_attention_large_scores_stay_finite() -> None:
    kv, slots, q, index, reqs = _case("float32", [(700, 700)], 2, 4, 64, seed=8)
    q = q * 30  # scores of std ~30: an unstabilised softmax overflows
    out = _run(q, kv, index, reqs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(kv, q, slots, reqs, 4), rtol=1e-4, atol=1e-4)


def test_prefill_attention_bits_ignore_threads_batch_and_chunking() -> None:
    """A row's bits are the same on 1 or 2 threads, next to other requests or alone, and whether its prompt
    was prefilled at once or in chunks (the chunks' earlier tokens then being a cached prefix)."""
    L = 650
    kv, slots, q, index, reqs = _case("bfloat16", [(L, L), (300, 77), (129, 129)], 2, 4, 64, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(q, kv, index, reqs)
        torch.set_num_threads(2)
        two = _run(q, kv, index, reqs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = _run(q[:L], kv, index[:L], reqs[:1])
    assert torch.equal(alone, two[:L])
    for step in (1, 100, 333):  # request 0 as chunked prefill: queries a .. b over keys 0 .. b - 1
        parts = []
        for a in range(0, L, step):
            b = min(L, a + step)
            part = torch.tensor([[0, b - a, b, 0]], dtype=torch.long)
            parts.append(_run(q[a:b].contiguous(), kv, index[:b], part))
        assert torch.equal(torch.cat(parts), two[:L])


@pytest.mark.parametrize("name", ["float32", "int8"])
def test_paged_attention_prefill_goes_fused(name: str) -> None:
    """Mixed steps (prompts, extends after a prefix, decodes) through the layer: the same as its torch path."""
    extend = [1, 200, 1, 5, 130, 1]
    lens = [40, 200, 3, 20, 300, 130]
    g = torch.Generator().manual_seed(4)
    cache = KVCache(1, 1024, 3, 64, torch.float32, torch.device("cpu"), name)
    cache.layer(0).write(torch.arange(1024), torch.randn(1024, 3, 64, generator=g),
                         torch.randn(1024, 3, 64, generator=g))
    perm = torch.randperm(1024, generator=g).tolist()
    slots, start = [], 0
    for n in lens:
        slots.append(perm[start:start + n])
        start += n
    q = torch.randn(sum(extend), 9, 64, generator=g)
    attn = PagedAttention(9, 3, 64, layer_id=0)
    out = _forward(attn, cache, q, extend, slots)
    previous = fused.set_enabled(False)
    try:
        ref = _forward(attn, cache, q, extend, slots)
    finally:
        fused.set_enabled(previous)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prefill_attention_checks_its_inputs() -> None:
    kv, slots, q, index, reqs = _case("float32", [(10, 4)], 1, 2, 64, seed=3)
    out = torch.empty(4, 128)
    with pytest.raises(RuntimeError, match="does not fit"):
        fused.prefill_attention(q, kv, index, torch.tensor([[0, 5, 10, 0]]), 0.125, out)
    with pytest.raises(RuntimeError, match="does not fit"):
        fused.prefill_attention(q, kv, index[:9], reqs, 0.125, out)
    with pytest.raises(RuntimeError, match="outside"):
        fused.prefill_attention(q, kv, index + 100, reqs, 0.125, out)
    with pytest.raises(RuntimeError, match="out must be"):
        fused.prefill_attention(q, kv, index, reqs, 0.125, torch.empty(4, 64))
    with pytest.raises(RuntimeError, match="float32"):
        fused.prefill_attention(q.double(), kv, index, reqs, 0.125, out)
