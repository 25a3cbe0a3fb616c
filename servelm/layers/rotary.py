"""Rotary position embeddings with a precomputed cos/sin cache.

Inverse frequencies come from transformers' own RoPE initialisers (default,
llama3, linear, yarn, ...), so scaling variants match the reference exactly.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from servelm.layers import fused
from servelm.layers.kernel_choice import kernels_of


def _rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = _rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"Unsupported rope type '{rope_type}'. Supported: default, "
                                 f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        if params.get("freq_factors"):  # a GGUF's rope_freqs divisors (model_loader.gguf), as llama.cpp applies them
            inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float)
        # Same fp32 product as the reference: position * inv_freq, then cos/sin.
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :].float()
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D] -> rotated (rotate-half convention, as in HF)."""
        if fused.available(q, k, self.cos, kernels=kernels_of(self)):
            return fused.rotary(positions, q, k, self.cos, self.sin)
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
