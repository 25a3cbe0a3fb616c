"""Which kernels a model's layers run, chosen once when the model is built (vLLM's `CustomOp` dispatch) and
frozen into its modules: the model runner resolves one `KernelChoice` from the server's arguments and the
machine, and `freeze_kernels` hands it to every module of the model. A layer then reads `kernels_of(self)`:
* `deterministic`: the batch-invariant paths (--enable-deterministic-inference): padded matmuls, the
  integer scheme of the quantised kernel at every row count, the batch-invariant attention;
* `fused`: the fused C++ decode ops (servelm.layers.fused), where the library is built and they are not
  switched off (`SERVELM_FUSED_OPS=0`); never with `deterministic`;
* `quant`: the quantised-weight kernel path (`servelm.kernels.quant`: avx512_vnni_i8, avx2_i8, ..., torch).

So a built model does not change its kernels when a process-wide switch flips later
(`batch_invariant.set_batch_invariant`, `fused.set_enabled`, `quant.force_backend`): those are only the defaults
`KernelChoice.from_process` reads, for a module that was never given a choice (layers built on their own, as
the layer tests do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ATTR = "_kernel_choice"


@dataclass(frozen=True)
class KernelChoice:
    deterministic: bool = False
    fused: bool = True
    quant: str = "torch"

    @property
    def mode(self) -> str:
        """deterministic, fused or native (the torch ops and the quantised kernel alone)."""
        return "deterministic" if self.deterministic else "fused" if self.fused else "native"

    @classmethod
    def resolve(cls, deterministic: bool, device: Any = "cpu") -> KernelChoice:
        """The choice for a model built now: deterministic as asked, the fused ops when the library loads and
        SERVELM_FUSED_OPS leaves them on, the quantised kernel path this CPU takes (SERVELM_QUANT_KERNEL). Off
        the CPU: torch alone, and the CPU kernels are neither built nor loaded."""
        if torch.device(device).type != "cpu":
            return cls(deterministic=deterministic, fused=False, quant="torch")
        from servelm.kernels import quant
        from servelm.layers import fused

        return cls(deterministic=deterministic, fused=not deterministic and fused.is_enabled() and fused.loaded(),
                   quant=quant.kernel_backend())

    @classmethod
    def from_process(cls) -> KernelChoice:
        """The process-wide switches as they are now (the defaults of a module without a choice)."""
        from servelm.kernels import quant
        from servelm.layers import batch_invariant, fused

        deterministic = batch_invariant.is_batch_invariant()
        return cls(deterministic=deterministic, fused=not deterministic and fused.is_enabled(),
                   quant=quant.kernel_backend())

    def describe(self) -> str:
        return f"{self.mode} (quantised kernels: {self.quant})"


def kernels_of(module: nn.Module) -> KernelChoice:
    """The choice frozen into `module`, else the process-wide defaults."""
    choice = module.__dict__.get(ATTR)
    return choice if choice is not None else KernelChoice.from_process()


def freeze_kernels(model: nn.Module, choice: KernelChoice) -> None:
    """Give every module of `model` the same choice (the model runner does it once, after building)."""
    for m in model.modules():
        m.__dict__[ATTR] = choice
