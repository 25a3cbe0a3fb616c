"""Attention over the paged KV cache in plain PyTorch.

Why this shape: on CPU, `index_select` / `index_copy_` beat advanced indexing
by far, and two small matmuls beat SDPA for a one-token decode query; so
decode uses explicit matmuls and prefill uses SDPA. For fp32 on CPU both are
fused C++ ops instead, which read the paged KV in its storage dtype:
`fused.decode_attention` (flash-decoding: the context split in chunks across
threads) and `fused.prefill_attention` (a blocked causal attention with an
online softmax: no gathered fp32 copy of the context, no mask, no [q, k]
matrix; about 2x SDPA's speed on 2 cores, docs/measurements/decode-attention.md).

With `--enable-deterministic-inference` both prefill and decode go through
one batch-invariant path instead (`BatchInvariantAttention`): SDPA and the
decode matmuls reduce over a key count that depends on the batch, and
neither MKL's gemm nor torch's sum gives the same bits when that length
changes. Measurements and costs of both paths:
docs/measurements/decode-attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from servelm.layers import fused
from servelm.layers.batch_invariant import RowRule, row_rule
from servelm.layers.kernel_choice import kernels_of
from servelm.mem_cache.memory_pool import LayerKV
from servelm.model_executor.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.layer_id = layer_id
        self.scale = head_dim ** -0.5
        self.invariant = BatchInvariantAttention(num_heads, num_kv_heads, head_dim, self.scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens only) -> [T, H*D]."""
        assert fb.kv_cache is not None
        kv = fb.kv_cache.layer(self.layer_id)
        kv.write(fb.out_cache_loc, k, v)
        return self._attend(q, kv, fb)

    def forward_cached(self, q: torch.Tensor, kv: LayerKV, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D] whose tokens' K/V are already in this layer's KV (written by
        `fused.qkv_rotary_cache`) -> [T, H*D]."""
        return self._attend(q, kv, fb)

    def _attend(self, q: torch.Tensor, kv: LayerKV, fb: ForwardBatch) -> torch.Tensor:
        if kernels_of(self).deterministic:
            return self.invariant(q, kv, fb)
        if fb.is_decode:
            return self._decode(q, kv, fb)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if fb.decode_tokens is not None:
            out.index_copy_(0, fb.decode_tokens, self._decode(q.index_select(0, fb.decode_tokens), kv, fb))
        if fused.available(q, kernels=kernels_of(self)) and fused.kv_available(kv):  # one C++ op (fp32, CPU)
            index, reqs = self._prefill_plan(fb)
            if reqs.shape[0]:
                fused.prefill_attention(q, kv, index, reqs, self.scale, out)
            return out
        gqa = self.num_heads != self.num_kv_heads
        start = 0
        for n, seq_len, index in zip(fb.extend_lens, fb.seq_lens, fb.kv_indices):
            start += n
            if n == 1:
                continue  # in the batched decode above
            prefix = seq_len - n
            qi = q[start - n:start].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki, vi = kv.gather(index)
            ki = ki.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vi = vi.transpose(0, 1).unsqueeze(0)
            if prefix == 0:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=gqa)
            else:
                # Query j sits at position prefix + j and sees keys 0..prefix + j.
                mask = (torch.arange(seq_len, device=q.device)[None, :]
                        <= (prefix + torch.arange(n, device=q.device))[:, None])
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
            out[start - n:start] = oi[0].transpose(0, 1).reshape(n, -1)
        return out

    def _prefill_plan(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's extend requests (more than one new token) for `fused.prefill_attention`: their page
        tables end to end, and a (q_start, n, seq_len, index offset) row each; once per forward."""
        return fb.memo("prefill_attention", lambda: self._build_prefill_plan(fb))

    @staticmethod
    def _build_prefill_plan(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        rows, tables, start, off = [], [], 0, 0
        for n, seq_len, index in zip(fb.extend_lens, fb.seq_lens, fb.kv_indices):
            if n > 1:  # one-token rows are in the batched decode
                rows.append((start, n, seq_len, off))
                tables.append(index[:seq_len])
                off += seq_len
            start += n
        index = torch.cat(tables) if tables else torch.zeros(0, dtype=torch.long)
        return index.to(torch.long).contiguous(), torch.tensor(rows, dtype=torch.long).view(-1, 4)

    def _decode(self, q: torch.Tensor, kv: LayerKV, fb: ForwardBatch) -> torch.Tensor:
        """q: [B, H, D] of the step's one-token requests (fb.decode_reqs) -> [B, H*D]."""
        if fused.available(q, kernels=kernels_of(self)) and fused.kv_available(kv):  # one C++ op (fp32, CPU)
            assert fb.decode_kv_index is not None and fb.decode_lens is not None
            return fused.decode_attention(q, kv, fb.decode_kv_index, fb.decode_lens, self.scale)
        rows, bias = self._decode_plan(fb, q.dtype)
        Hkv, g, D = self.num_kv_heads, self.group, self.head_dim
        B, L = fb.decode_kv_index.shape
        # Gathered straight into head-major [Hkv * B, L, D] from the cache seen as [slots * Hkv, D] rows, so
        # both bmms read contiguous batches with no copy (gathering [B * L, Hkv, D] and transposing made each
        # matmul copy its operand: 2x slower at batch 64).
        keys, values = kv.gather_rows(rows)
        keys, values = keys.view(Hkv * B, L, D), values.view(Hkv * B, L, D)
        # Query head h reads kv head h // group (HF's repeat_interleave order): [Hkv * B, group, D]
        qg = q.view(B, Hkv, g, D).transpose(0, 1).reshape(Hkv * B, g, D)
        scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=self.scale)  # [Hkv * B, group, L]
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.bmm(probs, values)  # [Hkv * B, group, D]
        return out.view(Hkv, B, g * D).transpose(0, 1).reshape(B, self.num_heads * D)

    def _decode_plan(self, fb: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows to gather ([Hkv * B * L], head-major) and the padding bias (0 or -inf, in the scores'
        dtype as baddbmm needs), once per forward."""
        return fb.memo(("decode_attention", self.num_kv_heads, self.group, dtype),
                       lambda: self._build_decode_plan(fb, dtype))

    def _build_decode_plan(self, fb: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert fb.decode_kv_index is not None and fb.decode_bias is not None
        hkv = self.num_kv_heads
        B, L = fb.decode_kv_index.shape
        heads = torch.arange(hkv, device=fb.decode_kv_index.device).view(hkv, 1)
        rows = (fb.decode_kv_index.view(1, -1) * hkv + heads).view(-1)
        bias = fb.decode_bias.view(1, B, 1, L).expand(hkv, B, self.group, L).reshape(hkv * B, self.group, L)
        return rows, bias.to(dtype)


# ---------------------------------------------------------------- batch-invariant attention
# Keys are split in chunks of KV_CHUNK positions aligned to position 0, so a
# query's chunks are the same however its request was batched, chunked or
# cached. Every reduction over keys has a fixed length: q.k over head_dim,
# the exp-sum and probs @ V over one chunk (KV_CHUNK), and the chunks are
# added in a fixed pairwise tree (`_tree_sum`); chunks past a query's position
# are all-masked and contribute exact zeros, which leave the tree's sums
# unchanged. The max subtracted before exp is the max over all the query's
# keys, which is exact in any order. The only batch-dependent shape left is
# the number of query rows per matmul, which `RowRule` pads to a count probed
# to be invariant (MKL's batched gemm here: any M >= 4; the group of 3 query
# heads per KV head of SmolLM2 is therefore padded to 4 rows).
# What this costs against the fast path, and why 64-key chunks:
# docs/measurements/decode-attention.md.
KV_CHUNK = 64
ATTENTION_PROBE_ROWS = 2048
PREFILL_SLAB_TOKENS = 4 * KV_CHUNK


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a pairwise tree whose shape depends only on each element's index.

    Element i is always combined with the same neighbours, and a missing
    neighbour counts as zero, so appending zero slices never changes the
    result (a plain torch.sum pairs its accumulators by length).
    """
    while x.shape[dim] > 1:
        if x.shape[dim] % 2:
            x = torch.cat([x, torch.zeros_like(x.narrow(dim, 0, 1))], dim)
        pairs = x.unflatten(dim, (-1, 2))
        x = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return x.squeeze(dim)


def attend_chunks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """The batch-invariant core.

    q: [Hkv, B, R, D] query rows; keys, values: [Hkv, B, nch, C, D]; mask:
    [1, B, nch, R, C] True where a key is not visible (later position or
    padding). Returns fp32 [Hkv, B, R, D]. Each row's result depends only on
    its own query, its request's keys and its position.
    """
    # q is broadcast over the chunks: one [R, D] x [D, C] product per (head, request, chunk). The
    # scale goes on q (an elementwise product rounds the same in every batch; q is much smaller
    # than the scores).
    scores = torch.matmul((q * scale).unsqueeze(2), keys.transpose(-1, -2)).float()  # [Hkv, B, nch, R, C]
    scores.masked_fill_(mask, float("-inf"))
    scores.sub_(scores.amax(dim=(2, 4), keepdim=True)).exp_()
    denom = _tree_sum(scores.sum(-1), 2)  # [Hkv, B, R]
    numer = _tree_sum(torch.matmul(scores.to(values.dtype), values).float(), 2)  # [Hkv, B, R, D]
    return numer / denom.unsqueeze(-1)


@dataclass
class _Unit:
    """Queries attended together: B requests with `n` new tokens each (B = 1 unless n = 1)."""

    tokens: torch.Tensor  # [B * n] rows of the flat batch, request-major
    B: int
    n: int
    rows: int  # padded rows per request (>= n * group)
    rows_index: torch.Tensor  # [Hkv * B * nch * C] rows of the cache viewed as [slots * Hkv, D]; padding
    # positions repeat the request's first slot
    nch: int
    mask: torch.Tensor  # [1, B, nch, rows, C]
    first: int | None  # when `tokens` is the contiguous range [first, first + B*n): a view, not a gather


def _probe_attention(head_dim: int, dtype: torch.dtype, device: torch.device) -> RowRule:
    """The row rule of `attend_chunks` on this machine: rows are (query, position) pairs."""
    gen = torch.Generator(device="cpu").manual_seed(99)
    kv = torch.randn(2, 1, 1, 2, KV_CHUNK, head_dim, generator=gen).to(dtype=dtype, device=device)
    key_pos = torch.arange(2 * KV_CHUNK, device=device).view(2, 1, KV_CHUNK)

    def fn(x: torch.Tensor) -> torch.Tensor:
        # The last column of a probe row encodes its query position.
        pos = (x[:, -1].float().abs() * 40).long() % (2 * KV_CHUNK)
        mask = (key_pos > pos.view(1, -1, 1)).view(1, 1, 2, -1, KV_CHUNK)
        q = x[:, :-1].reshape(1, 1, -1, head_dim)
        return attend_chunks(q, kv[0], kv[1], mask, head_dim ** -0.5)[0, 0]

    return row_rule(("attention", head_dim, KV_CHUNK), fn, head_dim + 1, dtype, device, ATTENTION_PROBE_ROWS,
                    f"attention head_dim={head_dim} chunk={KV_CHUNK}")


class BatchInvariantAttention(nn.Module):
    """Attention for prefill, extend and decode alike whose rows do not depend on the batch."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale

    def forward(self, q: torch.Tensor, kv: LayerKV, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D] (this step's tokens; their K/V already in the layer's KV) -> [T, H*D]."""
        units = self._plan(fb, q.dtype, q.device)
        Hkv, g, D = self.num_kv_heads, self.group, self.head_dim
        T = q.shape[0]
        out = None
        for u in units:
            # [B*n, H, D] -> [Hkv, B, n*g, D], rows padded with zero queries
            qu = q.narrow(0, u.first, u.B * u.n) if u.first is not None else q.index_select(0, u.tokens)
            qu = qu.view(u.B, u.n, Hkv, g, D).permute(2, 0, 1, 3, 4)
            qu = qu.reshape(Hkv, u.B, u.n * g, D)
            if u.rows > u.n * g:
                qu = torch.cat([qu, qu.new_zeros(Hkv, u.B, u.rows - u.n * g, D)], dim=2)
            # Gathered straight into [Hkv, B, nch, C, D] from the cache seen as [slots * Hkv, D] rows: 2.4x
            # faster than gathering [B*nch*C, Hkv, D] and permuting (measured at batch 64).
            keys, values = kv.gather_rows(u.rows_index)
            keys = keys.view(Hkv, u.B, u.nch, KV_CHUNK, D)
            values = values.view(Hkv, u.B, u.nch, KV_CHUNK, D)
            o = attend_chunks(qu, keys, values, u.mask, self.scale)
            # [Hkv, B, rows, D] -> [B*n, H*D]
            o = o[:, :, : u.n * g].reshape(Hkv, u.B, u.n, g, D).permute(1, 2, 0, 3, 4)
            o = o.reshape(u.B * u.n, -1).to(q.dtype)
            if u.first == 0 and u.B * u.n == T:
                return o  # one unit covering the whole step (pure decode, or one prefill chunk)
            if out is None:
                out = q.new_empty(T, self.num_heads * D)
            out.index_copy_(0, u.tokens, o)
        assert out is not None
        return out

    def _plan(self, fb: ForwardBatch, dtype: torch.dtype, device: torch.device) -> list[_Unit]:
        """The units of this step, built once per forward and shared by all layers."""
        return fb.memo(("invariant_attention", self.group, self.head_dim, dtype),
                       lambda: self._build_plan(fb, dtype, device))

    def _build_plan(self, fb: ForwardBatch, dtype: torch.dtype, device: torch.device) -> list[_Unit]:
        rule = _probe_attention(self.head_dim, dtype, device)
        g = self.group
        starts, offset = [], 0
        for n in fb.extend_lens:
            starts.append(offset)
            offset += n
        units: list[_Unit] = []
        decodes = [i for i, n in enumerate(fb.extend_lens) if n == 1]
        if decodes:
            units.append(self._unit([starts[i] for i in decodes], [fb.seq_lens[i] - 1 for i in decodes],
                                    [fb.kv_indices[i] for i in decodes], 1, rule, device))
        # Longer extends in slabs of tokens (rows are independent): each slab's rows fit the probed range,
        # and a slab only reads the chunks up to its last position, which skips most of the causal mask's
        # upper triangle in a long prefill.
        per_slab = max(1, min(PREFILL_SLAB_TOKENS, (rule.tile or rule.max_rows) // g))
        for i, n in enumerate(fb.extend_lens):
            if n == 1:
                continue
            prefix = fb.seq_lens[i] - n
            for a in range(0, n, per_slab):
                b = min(n, a + per_slab)
                units.append(self._unit([starts[i] + a], [prefix + a], [fb.kv_indices[i][: prefix + b]], b - a,
                                        rule, device))
        return units

    def _unit(self, starts: list[int], first_pos: list[int], kv: list[torch.Tensor], n: int, rule: RowRule,
              device: torch.device) -> _Unit:
        """B requests, each with n new tokens starting at flat row starts[b] and position first_pos[b]."""
        g, C = self.group, KV_CHUNK
        B = len(starts)
        rows = n * g
        rows = rule.tile if rule.tile is not None else max(rows, rule.min_rows)
        nch = max(-(-len(k) // C) for k in kv)
        slots = torch.empty(B, nch * C, dtype=torch.long, device=device)
        for b, k in enumerate(kv):
            slots[b, : len(k)] = k
            slots[b, len(k):] = k[0]
        flat = [s + i for s in starts for i in range(n)]
        first = flat[0] if flat == list(range(flat[0], flat[0] + len(flat))) else None
        tokens = torch.tensor(flat, dtype=torch.long, device=device)
        # Row (i, h) of request b holds token i: position first_pos[b] + i. Padding rows see key 0 only.
        pos = torch.zeros(B, rows, dtype=torch.long, device=device)
        pos[:, : n * g] = (torch.tensor(first_pos, device=device)[:, None]
                           + torch.arange(n, device=device)).repeat_interleave(g, dim=1)
        key_pos = torch.arange(nch * C, device=device).view(1, nch, 1, C)
        mask = (key_pos > pos.view(B, 1, rows, 1)).unsqueeze(0)
        hkv = self.num_kv_heads
        rows_index = (slots.view(1, -1) * hkv + torch.arange(hkv, device=device).view(hkv, 1)).view(-1)
        return _Unit(tokens, B, n, rows, rows_index, nch, mask, first)
