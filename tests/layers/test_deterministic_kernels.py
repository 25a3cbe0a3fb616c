"""Batch-invariant building blocks: the row-rule probe, the chunk tree sum, and attention itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.layers import batch_invariant
from servelm.layers.attention import KV_CHUNK, BatchInvariantAttention, PagedAttention, _tree_sum
from servelm.layers.batch_invariant import RowRule, invariant_linear
from servelm.mem_cache.memory_pool import KVCache
from servelm.model_executor.forward_batch import ForwardBatch


@pytest.fixture(autouse=True)
def _restore_flag():
    before = batch_invariant.is_batch_invariant()
    yield
    batch_invariant.set_batch_invariant(before)


W = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))


def _bumped_below(m0: int):
    """A row-wise product whose rows are off by a little when the call has fewer than m0 rows."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 3.0  # exact per element, unlike a real matmul
        return y + 1e-3 if x.shape[0] < m0 else y
    return fn


@pytest.mark.parametrize(("m0", "expected"), [(1, 1), (2, 2), (3, 4), (4, 4), (12, 12), (13, 16)])
def test_probe_finds_the_smallest_safe_row_count(m0: int, expected: int) -> None:
    rule = RowRule.probe(_bumped_below(m0), 16, torch.float32, torch.device("cpu"), 128, "test")
    assert rule == RowRule(min_rows=expected, max_rows=128)


def test_probe_falls_back_to_tiles_when_one_size_in_the_middle_differs() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 3.0
        return y + 1e-3 if x.shape[0] == 65 else y
    assert RowRule.probe(fn, 16, torch.float32, torch.device("cpu"), 128, "test").tile == 16


def test_probe_raises_when_rows_depend_on_their_position() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 3.0 + torch.arange(x.shape[0])[:, None] * 1e-3
    with pytest.raises(RuntimeError, match="no batch-invariant way"):
        RowRule.probe(fn, 16, torch.float32, torch.device("cpu"), 128, "test")


def test_rule_only_calls_allowed_row_counts() -> None:
    seen: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x @ W.T

    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(4))
    for rule, allowed in [(RowRule(4, 128), lambda m: 4 <= m <= 128), (RowRule(16, 16, tile=16), lambda m: m == 16)]:
        seen.clear()
        for m in (1, 3, 4, 100, 128, 129, 300):
            torch.testing.assert_close(rule.apply(x[:m], fn), x[:m] @ W.T, rtol=0, atol=1e-5)
        assert seen and all(allowed(m) for m in seen)


def test_invariant_linear_rows_do_not_depend_on_the_batch() -> None:
    """Both linear kernels of the engine, through the probe, at every batch size."""
    w = torch.randn(96, 1536, generator=torch.Generator().manual_seed(6)) * 0.05
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(5))
    kernels = {"aten": lambda t: F.linear(t, w),
               "onednn": lambda t: torch.ops.mkldnn._linear_pointwise(t, packed, None, "none", [], "")}
    for kind, fn in kernels.items():
        ref = invariant_linear(x, fn, f"test-{kind}", 96)
        for m in range(1, 20):
            for off in (0, 5):
                assert torch.equal(invariant_linear(x[off:off + m], fn, f"test-{kind}", 96), ref[off:off + m]), \
                    (kind, m, off)


def test_tree_sum_ignores_appended_zero_slices() -> None:
    x = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(3)) * 1e3
    ref = _tree_sum(x, 1)
    for extra in range(1, 12):
        padded = torch.cat([x, torch.zeros(3, extra, 5)], dim=1)
        assert torch.equal(_tree_sum(padded, 1), ref)
    torch.testing.assert_close(ref, x.double().sum(1).float(), rtol=1e-5, atol=1e-3)


def _attention_case(group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hkv, d = 2, 16
    cache = KVCache(1, 2048, hkv, d, torch.float32, torch.device("cpu"))
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    return hkv * group, hkv, d, cache, gen


def _run(attn: PagedAttention, cache: KVCache, q: torch.Tensor, extend_lens: list[int], seq_lens: list[int],
         slots: list[list[int]]) -> torch.Tensor:
    """One forward over requests whose new tokens are the last extend_lens[i] of slots[i]."""
    pos, out_loc, ids = [], [], []
    for n, L, s in zip(extend_lens, seq_lens, slots):
        pos += list(range(L - n, L))
        out_loc += s[L - n:L]
        ids += [0] * n
    fb = ForwardBatch.build(ids, pos, out_loc, extend_lens, [s[:L] for L, s in zip(seq_lens, slots)],
                            [len(ids) - 1], torch.device("cpu"))
    fb.kv_cache = cache
    k = cache.k[0].index_select(0, fb.out_cache_loc).clone()
    v = cache.v[0].index_select(0, fb.out_cache_loc).clone()
    return attn(q, k, v, fb)


@pytest.mark.parametrize("group", [1, 3])
def test_attention_row_is_the_same_in_prefill_chunks_and_decode_batches(group: int) -> None:
    """One request's query rows: full prefill == any chunking == decode inside batches of other lengths."""
    batch_invariant.set_batch_invariant(True)
    h, hkv, d, cache, gen = _attention_case(group)
    attn = PagedAttention(h, hkv, d, layer_id=0)
    L = 3 * KV_CHUNK + 11
    slots = torch.randperm(2048, generator=gen)[:L].tolist()
    q_all = torch.randn(L, h, d, generator=gen)
    full = _run(attn, cache, q_all, [L], [L], [slots])
    # Reference: plain causal attention in float64.
    keys = cache.k[0, slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
    values = cache.v[0, slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(q_all.double().transpose(0, 1), keys, values, is_causal=True)
    torch.testing.assert_close(full, ref.transpose(0, 1).reshape(L, -1).float(), rtol=1e-5, atol=1e-5)
    for chunk in (1, 7, 64, 100):
        rows = [_run(attn, cache, q_all[a:a + chunk], [min(chunk, L - a)], [min(a + chunk, L)], [slots])
                for a in range(0, L, chunk)]
        assert torch.equal(torch.cat(rows), full), chunk
    # Decode of the last few positions next to other requests of other lengths, at different batch positions.
    others = [torch.randperm(2048, generator=gen)[:n].tolist() for n in (5, 300, 64, 129)]
    for t in (L - 1, L - 40, KV_CHUNK - 1, KV_CHUNK):
        for k in range(len(others) + 1):
            batch = others[:k] + [slots] + others[k:]
            lens = [len(s) for s in others[:k]] + [t + 1] + [len(s) for s in others[k:]]
            q = torch.randn(len(batch), h, d, generator=gen)
            q[k] = q_all[t]
            out = _run(attn, cache, q, [1] * len(batch), lens, batch)
            assert torch.equal(out[k], full[t]), (t, k)


def test_mixed_batches_use_the_same_path() -> None:
    """A prefill chunk and decodes in one step give the rows they give apart."""
    batch_invariant.set_batch_invariant(True)
    h, hkv, d, cache, gen = _attention_case(2, seed=1)
    attn = PagedAttention(h, hkv, d, layer_id=0)
    a = torch.randperm(2048, generator=gen)[:90].tolist()
    b = torch.randperm(2048, generator=gen)[:40].tolist()
    qa, qb = torch.randn(90, h, d, generator=gen), torch.randn(1, h, d, generator=gen)
    alone_a = _run(attn, cache, qa[50:], [40], [90], [a])
    alone_b = _run(attn, cache, qb, [1], [40], [b])
    mixed = _run(attn, cache, torch.cat([qb, qa[50:]]), [1, 40], [40, 90], [b, a])
    assert torch.equal(mixed[:1], alone_b) and torch.equal(mixed[1:], alone_a)


def test_off_switch_keeps_the_fast_path() -> None:
    batch_invariant.set_batch_invariant(False)
    h, hkv, d, cache, gen = _attention_case(2)
    attn = PagedAttention(h, hkv, d, layer_id=0)

    def boom(*args: object) -> None:
        raise AssertionError("batch-invariant path used with the switch off")
    attn.invariant.forward = boom  # type: ignore[method-assign]
    slots = torch.randperm(2048, generator=gen)[:20].tolist()
    _run(attn, cache, torch.randn(20, h, d, generator=gen), [20], [20], [slots])
    assert isinstance(attn.invariant, BatchInvariantAttention)


def test_silu_and_mul_is_elementwise_invariant_unlike_f_silu() -> None:
    batch_invariant.set_batch_invariant(True)
    x = torch.randn(70000, generator=torch.Generator().manual_seed(8)) * 6
    ones = torch.ones_like(x)
    ref = batch_invariant.silu_and_mul(x, ones)
    torch.testing.assert_close(ref, F.silu(x), rtol=1e-5, atol=1e-6)
    for n in (1, 5, 17, 31, 33, 1001, 40001):
        for off in (0, 7):
            assert torch.equal(batch_invariant.silu_and_mul(x[off:off + n], ones[:n]), ref[off:off + n])
    batch_invariant.set_batch_invariant(False)
    assert torch.equal(batch_invariant.silu_and_mul(x, ones), F.silu(x))
