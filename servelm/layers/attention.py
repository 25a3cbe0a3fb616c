"""Attention over the paged KV cache in plain PyTorch.

NOTE (CPU performance): advanced indexing (`cache[idx]`) and `index_put_` are
~100x slower than `index_select` / `index_copy_` for these shapes on CPU, and
SDPA costs ~0.4 ms per call for a one-token decode query while two small
matmuls take ~0.02 ms; so decode uses explicit matmuls and prefill uses SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.model_executor.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.layer_id = layer_id
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens only) -> [T, H*D]."""
        assert fb.kv_cache is not None
        k_cache, v_cache = fb.kv_cache.k[self.layer_id], fb.kv_cache.v[self.layer_id]
        k_cache.index_copy_(0, fb.out_cache_loc, k)
        v_cache.index_copy_(0, fb.out_cache_loc, v)
        if fb.is_decode:
            return self._decode(q, k_cache, v_cache, fb)
        gqa = self.num_heads != self.num_kv_heads
        outs = []
        start = 0
        for n, seq_len, index in zip(fb.extend_lens, fb.seq_lens, fb.kv_indices):
            prefix = seq_len - n
            qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_cache.index_select(0, index).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vi = v_cache.index_select(0, index).transpose(0, 1).unsqueeze(0)
            if prefix == 0:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=gqa)
            else:
                # Query j sits at position prefix + j and sees keys 0..prefix + j.
                mask = (torch.arange(seq_len, device=q.device)[None, :]
                        <= (prefix + torch.arange(n, device=q.device))[:, None])
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
            outs.append(oi[0].transpose(0, 1).reshape(n, -1))
            start += n
        return torch.cat(outs, dim=0)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        assert fb.decode_kv_index is not None and fb.decode_bias is not None
        B, L = fb.decode_kv_index.shape
        flat = fb.decode_kv_index.view(-1)
        # [B*L, Hkv, D] -> [B, Hkv, L, D]
        keys = k_cache.index_select(0, flat).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # Query head h reads kv head h // group (HF's repeat_interleave order): [B, Hkv, group, D]
        qg = q.view(B, self.num_kv_heads, self.group, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale  # [B, Hkv, group, L]
        scores = scores.float() + fb.decode_bias  # bias [B, 1, 1, L]: 0 or -inf on padding
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # [B, Hkv, group, D]
        return out.reshape(B, self.num_heads * self.head_dim)
