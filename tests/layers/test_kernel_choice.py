"""The kernel choice is made once per model and frozen into its modules: flipping the process-wide switches
afterwards (deterministic mode, the fused ops, the quantised kernel path) changes nothing in a built model,
while a module never given a choice still follows them."""

from __future__ import annotations

import pytest
import torch

from servelm.kernels import quant
from servelm.layers import batch_invariant, fused
from servelm.layers.kernel_choice import KernelChoice, freeze_kernels, kernels_of
from servelm.layers.layernorm import RMSNorm
from servelm.layers.linear import RowParallelLinear


@pytest.fixture(autouse=True)
def _restore():
    enabled, invariant, backend = fused.is_enabled(), batch_invariant.is_batch_invariant(), quant.kernel_backend()
    yield
    fused.set_enabled(enabled)
    batch_invariant.set_batch_invariant(invariant)
    quant.force_backend(backend)


def test_modes_and_resolution() -> None:
    assert KernelChoice(deterministic=True, fused=False).mode == "deterministic"
    assert KernelChoice(fused=True).mode == "fused" and KernelChoice(fused=False).mode == "native"
    det = KernelChoice.resolve(deterministic=True)
    assert det.deterministic and not det.fused and det.quant == quant.kernel_backend()
    assert KernelChoice.resolve(deterministic=False).fused == (fused.is_enabled() and fused.loaded())
    fused.set_enabled(False)
    assert not KernelChoice.resolve(deterministic=False).fused and not KernelChoice.from_process().fused


def test_a_frozen_module_ignores_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    norm = RMSNorm(8)
    calls = []
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append("fused") or norm._norm(a[0]))
    x = torch.randn(2, 8)
    freeze_kernels(norm, KernelChoice(fused=False, quant="torch"))
    fused.set_enabled(True)
    norm(x)
    assert calls == []  # frozen without the fused ops: the process switch does not bring them back
    if fused.loaded():
        freeze_kernels(norm, KernelChoice(fused=True, quant="torch"))
        fused.set_enabled(False)
        norm(x)
        assert calls == ["fused"]
    del norm.__dict__["_kernel_choice"]  # never given one: follows the switches
    fused.set_enabled(False)
    norm(x)
    assert kernels_of(norm) == KernelChoice.from_process() and len(calls) == (1 if fused.loaded() else 0)


def test_a_frozen_linear_keeps_its_quant_path_and_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = quant.linear
    monkeypatch.setattr(quant, "linear", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    layer = RowParallelLinear(64, 16)
    layer.qweight = quant.quantize(torch.randn(16, 64), "q4_0")
    freeze_kernels(layer, KernelChoice(deterministic=True, fused=False, quant="torch"))
    batch_invariant.set_batch_invariant(False)
    quant.force_backend(None)
    layer(torch.randn(3, 64))
    assert seen and seen[-1]["backend"] == "torch"
    if quant.kernel_backend() != "torch":  # the C++ kernel: deterministic keeps the integer scheme
        freeze_kernels(layer, KernelChoice(deterministic=True, fused=False, quant=quant.kernel_backend()))
        layer(torch.randn(12, 64))
        assert seen[-1] == {"invariant": True, "backend": quant.kernel_backend()}


def test_the_model_runner_freezes_one_choice(tiny_llama) -> None:
    from servelm.config import ServerArgs
    from servelm.model_executor.model_runner import ModelRunner

    runner = ModelRunner(ServerArgs(model_path=str(tiny_llama[0]), max_total_tokens=256,
                                    enable_deterministic_inference=True))
    assert runner.kernels.deterministic and not runner.kernels.fused
    assert {id(kernels_of(m)) for m in runner.model.modules()} == {id(runner.kernels)}
    batch_invariant.set_batch_invariant(False)  # later switches leave the built model alone
    assert all(kernels_of(m).deterministic for m in runner.model.modules())
