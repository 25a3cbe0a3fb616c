"""servelm.layers.fused: each C++ op (every ISA this CPU has) against the layers' own torch code, on odd shapes;
the switches that keep the torch path (SERVELM_FUSED_OPS / set_enabled, deterministic mode, other dtypes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from servelm.layers import batch_invariant, fused
from servelm.layers.attention import PagedAttention
from servelm.layers.batch_invariant import silu_and_mul
from servelm.layers.layernorm import RMSNorm
from servelm.layers.rotary import RotaryEmbedding
from servelm.mem_cache.memory_pool import KVCache, LayerKV
from servelm.model_executor.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(not fused.loaded(), reason="the C++ kernels cannot be built here")

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _restore_switches():
    enabled, invariant = fused.is_enabled(), batch_invariant.is_batch_invariant()
    yield
    fused.set_enabled(enabled)
    batch_invariant.set_batch_invariant(invariant)


def _torch_path(fn, *args):
    previous = fused.set_enabled(False)
    try:
        return fn(*args)
    finally:
        fused.set_enabled(previous)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_switches() -> None:
    x = torch.randn(3, 8)
    assert fused.available(x)
    fused.set_enabled(False)
    assert not fused.available(x)
    fused.set_enabled(True)
    batch_invariant.set_batch_invariant(True)
    assert not fused.available(x)
    batch_invariant.set_batch_invariant(False)
    assert not fused.available(x.double()) and not fused.available(x.bfloat16()) and not fused.available(x, x.half())


@pytest.mark.parametrize("D", [1, 13, 64, 576, 577])
def test_rms_norm(isa: int, D: int) -> None:
    g = _gen(D)
    norm = RMSNorm(D, eps=1e-5)
    norm.weight.data.normal_(generator=g)
    for T in range(1, 8):
        x = torch.randn(T, D, generator=g) * 3
        res = torch.randn(T, D, generator=g)
        ref = _torch_path(norm, x)
        ref_y, ref_s = _torch_path(norm, x, res)
        torch.testing.assert_close(norm(x), ref, **TOL)
        y, s = norm(x, res)
        torch.testing.assert_close(y, ref_y, **TOL)
        assert torch.equal(s, ref_s) and torch.equal(s, x + res)


def test_rms_norm_many_rows_and_head_views(isa: int) -> None:
    """Threaded (many rows), and Qwen3's q/k norm: [T, H, D] views of a fused qkv (not contiguous)."""
    g = _gen(1)
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data.normal_(generator=g)
    qkv = torch.randn(300, 9 * 64 + 2 * 3 * 64, generator=g)
    q = qkv[:, : 9 * 64].view(300, 9, 64)
    assert not q.is_contiguous()
    out = norm(q)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _torch_path(norm, q), **TOL)
    x, res = torch.randn(2000, 576, generator=g), torch.randn(2000, 576, generator=g)
    big = RMSNorm(576)
    y, s = big(x, res)
    ref_y, ref_s = _torch_path(big, x, res)
    torch.testing.assert_close(y, ref_y, **TOL)
    assert torch.equal(s, ref_s)


def test_rms_norm_changes_something() -> None:
    """The fused op is the one running (its sum of squares differs from torch's in the last bits somewhere)."""
    g = _gen(2)
    norm = RMSNorm(577)
    x = torch.randn(64, 577, generator=g)
    assert not torch.equal(norm(x), _torch_path(norm, x))


@pytest.mark.parametrize(("H", "Hkv", "D"), [(9, 3, 64), (4, 4, 64), (8, 2, 128), (12, 3, 128), (2, 1, 16)])
def test_rotary(isa: int, H: int, Hkv: int, D: int) -> None:
    g = _gen(H * D)
    config = LlamaConfig(rope_theta=10000.0, max_position_embeddings=4096)
    rope = RotaryEmbedding(config, D, 4096)
    for T in (*range(1, 8), 300):
        qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
        q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k = q.view(T, H, D), k.view(T, Hkv, D)  # strided token rows, as in the model
        positions = torch.randint(0, 4096, (T,), generator=g)
        positions[0] = 4095
        qo, ko = rope(positions, q, k)
        qr, kr = _torch_path(rope, positions, q, k)
        # the same multiplies and adds as torch's, each rounded once: equal bits
        assert torch.equal(qo, qr) and torch.equal(ko, kr)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        rope(torch.tensor([4096]), q[:1], k[:1])


@pytest.mark.parametrize(("H", "Hkv", "D"), [(9, 3, 64), (4, 4, 64), (8, 2, 128), (12, 3, 128)])
def test_qkv_rotary_cache(isa: int, H: int, Hkv: int, D: int) -> None:
    """q rotated, k rotated and v written into the caches: what split + rotary + index_copy_ do."""
    g = _gen(H * D + 1)
    rope = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), D, 2048)
    for T in (*range(1, 8), 200):
        qkv = torch.randn(T, (H + 2 * Hkv) * D + 5, generator=g)[:, 5:]  # strided rows, as a slice would be
        positions = torch.randint(0, 2048, (T,), generator=g)
        loc = torch.randperm(500, generator=g)[:T]
        caches = [torch.randn(500, Hkv, D, generator=g) for _ in range(2)]
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        kv = LayerKV(k_cache, v_cache, None, None, torch.float32)
        q = fused.qkv_rotary_cache(qkv, positions, rope.cos, rope.sin, kv, loc, H)
        q_ref, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q_ref, k_ref = _torch_path(rope, positions, q_ref.view(T, H, D), k.view(T, Hkv, D))
        caches[0].index_copy_(0, loc, k_ref)
        caches[1].index_copy_(0, loc, v.reshape(T, Hkv, D))
        assert torch.equal(q, q_ref) and torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    with pytest.raises(RuntimeError, match="outside"):
        fused.qkv_rotary_cache(qkv[:1], positions[:1], rope.cos, rope.sin, kv, torch.tensor([500]), H)


def test_rotary_scaled_rope() -> None:
    """A scaled RoPE (llama3): the cache carries the scaling, the op reads the cache."""
    config = LlamaConfig(rope_theta=500000.0, max_position_embeddings=8192, head_dim=64, hidden_size=512,
                         num_attention_heads=8,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    rope = RotaryEmbedding(config, 64, 8192)
    g = _gen(5)
    q, k = torch.randn(5, 8, 64, generator=g), torch.randn(5, 2, 64, generator=g)
    positions = torch.tensor([0, 1, 1023, 5000, 8191])
    qo, ko = rope(positions, q, k)
    qr, kr = _torch_path(rope, positions, q, k)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)


@pytest.mark.parametrize("inter", [1, 7, 16, 1536, 1537])
def test_silu_and_mul(isa: int, inter: int) -> None:
    g = _gen(inter)
    for T in (*range(1, 8), 100):
        gate_up = torch.randn(T, 2 * inter, generator=g) * 8
        ref = silu_and_mul(*gate_up.chunk(2, dim=-1))
        torch.testing.assert_close(fused.silu_and_mul(gate_up), ref, **TOL)


def test_silu_extremes(isa: int) -> None:
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0])])
    gate_up = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    out = fused.silu_and_mul(gate_up)[0]
    ref = F.silu(gate.double()).float()
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("V", [1, 3, 4, 8, 15, 16, 17, 100, 49152, 151937])
def test_argmax_rows_equals_torch_argmax(isa: int, V: int) -> None:
    """The same indices as torch.argmax on random rows, many ties (the first wins), -inf runs, rows all -inf,
    NaNs (counted as the largest: the first NaN wins), +inf, the maximum in the tail past the last whole vector."""
    g = _gen(V)
    for trial in range(24):
        R = 1 + trial % 5
        x = torch.randn(R, V, generator=g)
        if trial % 3 == 1:
            x = torch.randint(-3, 3, (R, V), generator=g).float()
        if trial % 4 == 2:
            x[:, ::3] = float("-inf")
        if trial % 6 == 3:
            x[0, torch.randint(0, V, (1,), generator=g)] = float("nan")
            x[-1, -1] = float("nan")
        if trial % 8 == 4:
            x[0] = float("-inf")
        if trial % 5 == 4:
            x[:, -1] = x[:, -1].abs() + 100
        if trial % 7 == 5:
            x[-1, V // 2] = float("inf")
        assert torch.equal(fused.argmax_rows(x), x.argmax(dim=-1)), (V, trial)
    assert fused.argmax_rows(torch.empty(0, V)).shape == (0,)


def test_greedy_argmax_takes_the_op_for_fp32_on_cpu_and_torch_elsewhere(monkeypatch) -> None:
    calls = []
    op = fused.argmax_rows

    def spy(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.is_contiguous())
        return op(x)

    monkeypatch.setattr(fused, "argmax_rows", spy)
    x = torch.randn(4, 1000)
    x[:, 7] = 50
    assert fused.greedy_argmax(x).tolist() == [7] * 4 and calls == [True]
    assert fused.greedy_argmax(x.t().contiguous().t()).tolist() == [7] * 4 and calls == [True, True]  # copied
    assert fused.greedy_argmax(x.double()).tolist() == [7] * 4 and len(calls) == 2  # torch.argmax
    fused.set_enabled(False)
    assert fused.greedy_argmax(x).tolist() == [7] * 4 and len(calls) == 2
    with pytest.raises(RuntimeError, match=r"argmax_rows takes \[R, V\]"):
        op(torch.randn(5))


def _decode_case(group: int, D: int, lens: list[int], seed: int, hkv: int = 3):
    g = _gen(seed)
    cache = KVCache(2, 4096, hkv, D, torch.float32, torch.device("cpu"))
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    perm = torch.randperm(4096, generator=g).tolist()
    slots, start = [], 0
    for n in lens:
        slots.append(perm[start:start + n])
        start += n
    q = torch.randn(len(lens), hkv * group, D, generator=g)
    return cache, slots, q


def _forward(attn: PagedAttention, cache: KVCache, q: torch.Tensor, extend_lens: list[int],
             slots: list[list[int]]) -> torch.Tensor:
    pos, out_loc = [], []
    for n, s in zip(extend_lens, slots):
        pos += list(range(len(s) - n, len(s)))
        out_loc += s[len(s) - n:]
    fb = ForwardBatch.build([0] * len(pos), pos, out_loc, extend_lens, slots, [len(pos) - 1], torch.device("cpu"))
    fb.kv_cache = cache
    k, v = cache.layer(attn.layer_id).gather(fb.out_cache_loc)  # decoded: they encode to the same bits
    return attn(q, k, v, fb)


def _reference(cache: KVCache, layer: int, q: torch.Tensor, slots: list[list[int]], group: int) -> torch.Tensor:
    """Plain float64 attention of each request's one query over its slots."""
    outs = []
    for b, s in enumerate(slots):
        keys = cache.k[layer, s].double().repeat_interleave(group, dim=1)  # [L, H, D]
        values = cache.v[layer, s].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), keys) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values).reshape(-1))
    return torch.stack(outs).float()


@pytest.mark.parametrize(("group", "D"), [(1, 64), (3, 64), (4, 64), (3, 128), (4, 128)])
def test_decode_attention(isa: int, group: int, D: int) -> None:
    """Batches of 1..7 decodes with lengths 1..130 (padded rows in the batch), against the torch path."""
    g = _gen(group * D)
    for B in range(1, 8):
        lens = torch.randint(1, 131, (B,), generator=g).tolist()
        if B == 2:
            lens = [1, 130]
        cache, slots, q = _decode_case(group, D, lens, seed=B * 31 + group)
        attn = PagedAttention(3 * group, 3, D, layer_id=1)
        out = _forward(attn, cache, q, [1] * B, slots)
        ref = _torch_path(_forward, attn, cache, q, [1] * B, slots)
        torch.testing.assert_close(out, ref, **TOL)
        torch.testing.assert_close(out, _reference(cache, 1, q, slots, group), **TOL)


def test_decode_attention_threaded_and_large_scores(isa: int) -> None:
    """Enough work to be split across threads; scores large enough that an unstabilised softmax overflows."""
    lens = [130, 1, 77, 129, 64, 2, 128, 100] * 4
    cache, slots, q = _decode_case(4, 128, lens, seed=7, hkv=2)
    q = q * 10  # scores of std ~10: both fp32 paths are ~5e-6 off the float64 result
    attn = PagedAttention(8, 2, 128, layer_id=0)
    out = _forward(attn, cache, q, [1] * len(lens), slots)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(cache, 0, q, slots, 4), **TOL)
    torch.testing.assert_close(out, _torch_path(_forward, attn, cache, q, [1] * len(lens), slots), rtol=1e-5,
                               atol=2e-5)


def test_decode_attention_in_a_mixed_step() -> None:
    """Decodes batched next to a prefill and an extend (fb.decode_tokens set): the decode rows go fused."""
    extend = [1, 9, 1, 5, 1]
    lens = [40, 9, 3, 20, 130]
    cache, slots, _ = _decode_case(3, 64, lens, seed=11)
    q = torch.randn(sum(extend), 9, 64, generator=_gen(12))
    attn = PagedAttention(9, 3, 64, layer_id=0)
    out = _forward(attn, cache, q, extend, slots)
    torch.testing.assert_close(out, _torch_path(_forward, attn, cache, q, extend, slots), **TOL)


def test_decode_attention_checks_its_inputs() -> None:
    cache, slots, q = _decode_case(3, 64, [5, 3], seed=3)
    index = torch.tensor([slots[0], slots[1] + [slots[1][0]] * 2])
    kv = cache.layer(0)
    with pytest.raises(RuntimeError, match="attends to"):
        fused.decode_attention(q, kv, index, torch.tensor([5, 6]), 0.125)
    with pytest.raises(RuntimeError, match="outside"):
        fused.decode_attention(q, kv, index + 4096, torch.tensor([5, 3]), 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        fused.decode_attention(q.double(), kv, index, torch.tensor([5, 3]), 0.125)


def test_fused_isa_by_name_and_from_the_environment() -> None:
    """`fused.set_isa` by name (None: the best), a clear error for an unknown or too fast one, and
    SERVELM_FUSED_ISA applied when a process loads the ops."""
    best = fused.ISA_NAMES[torch.ops.servelm_fused.best_isa()]
    try:
        assert fused.set_isa("sse2") == "sse2" and fused.isa() == "sse2"
        assert fused.set_isa(None) == best and fused.isa() == best
        with pytest.raises(ValueError, match="expected one of sse2, avx2, avx512, avx512_bf16"):
            fused.set_isa("avx9")
        if best != "avx512_bf16":
            with pytest.raises(ValueError, match=f"this CPU supports at most {best}"):
                fused.set_isa("avx512_bf16")
    finally:
        fused.set_isa(None)
    code = "from servelm.layers import fused; print(fused.isa())"
    env = {**os.environ, fused.ISA_ENV: "SSE2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split()[-1] == "sse2", out.stderr[-2000:]
