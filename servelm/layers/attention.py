"""Attention over the paged KV cache in plain PyTorch (SDPA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.model_executor.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_id = layer_id
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens only) -> [T, H*D]."""
        assert fb.kv_cache is not None
        k_cache, v_cache = fb.kv_cache.k[self.layer_id], fb.kv_cache.v[self.layer_id]
        k_cache[fb.out_cache_loc] = k
        v_cache[fb.out_cache_loc] = v
        gqa = self.num_heads != self.num_kv_heads
        if fb.is_decode:
            # [B, Lmax, Hkv, D] -> [B, Hkv, Lmax, D]; q: [B, H, 1, D]
            keys = k_cache[fb.decode_kv_index].transpose(1, 2)
            values = v_cache[fb.decode_kv_index].transpose(1, 2)
            out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=fb.decode_mask,
                                                 scale=self.scale, enable_gqa=gqa)
            return out.reshape(q.shape[0], -1)
        outs = []
        start = 0
        for n, seq_len, index in zip(fb.extend_lens, fb.seq_lens, fb.kv_indices):
            prefix = seq_len - n
            qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_cache[index].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vi = v_cache[index].transpose(0, 1).unsqueeze(0)
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
