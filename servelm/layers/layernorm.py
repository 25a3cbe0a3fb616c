from __future__ import annotations

import torch
from torch import nn

from servelm.layers import fused
from servelm.layers.kernel_choice import kernels_of


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 as in the HF reference, optionally fused with a residual add (one C++ op for
    fp32 on CPU: `servelm.layers.fused`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(orig)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused.available(x, self.weight, kernels=kernels_of(self)) and (
                residual is None or residual.dtype == torch.float32):
            return fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
