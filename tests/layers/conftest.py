"""Fixtures of the layer tests: `isa`, every instruction set the C++ kernels have on this CPU, one at a time."""

from __future__ import annotations

import pytest
import torch

from servelm.layers import fused

ISAS = list(range(torch.ops.servelm_fused.best_isa() + 1)) if fused.loaded() else []


@pytest.fixture(params=ISAS, ids=lambda i: ("sse2", "avx2", "avx512", "avx512_bf16")[i])
def isa(request):
    """The C++ ops on this ISA level for the test (sse2, avx2, avx512, avx512_bf16: AVX-512 whose decode attention
    over a bf16 cache takes bf16 products; as far as the CPU goes), then the best."""
    assert torch.ops.servelm_fused.set_isa(request.param) == request.param
    yield request.param
    torch.ops.servelm_fused.set_isa(-1)
