"""The captured decode step (servelm.model_executor.cuda_graph_runner) and the CUDA device choices, on the CPU.

`EagerGraph` replays by rerunning the recorded function on the static buffers, so everything but the capture
itself runs here: padding the batch to a captured size, the key buckets, the pad slot, the one buffer the
inputs travel in. The CUDA device is faked where only the choices are under test.
"""

from __future__ import annotations

import logging

import pytest
import torch

from servelm.config import ConfigError, ServerArgs
from servelm.layers.kernel_choice import KernelChoice
from servelm.managers.schedule_batch import StepInput
from servelm.mem_cache.memory_pool import resolve_kv_dtype
from servelm.model_executor.cuda_graph_runner import DecodeGraphs, EagerGraph, capture_sizes, key_bucket
from servelm.model_executor.forward_batch import ForwardBatch
from servelm.model_executor.model_runner import ModelRunner, check_device_support, resolve_device, resolve_dtype
from servelm.model_loader.quantization import resolve_quantization


def test_capture_sizes_and_key_buckets() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64]
    assert capture_sizes(1000)[-1] == 256
    assert [key_bucket(n) for n in (1, 256, 257, 512, 513, 5000)] == [256, 256, 512, 512, 1024, 8192]


@pytest.fixture(scope="module")
def runner(tiny_llama) -> ModelRunner:
    path, _ = tiny_llama
    return ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=4096))


def _decode_step(ids: list[int], slots: list[list[int]]) -> StepInput:
    """One decode token per request: request b adds ids[b] at the position after its slots[b][:-1]."""
    return StepInput(input_ids=ids, positions=[len(s) - 1 for s in slots], out_cache_loc=[s[-1] for s in slots],
                     extend_lens=[1] * len(ids), kv_indices=slots, logits_indices=list(range(len(ids))))


def _prefill(runner: ModelRunner, prompt: list[int], slots: list[int]) -> None:
    step = StepInput(input_ids=prompt, positions=list(range(len(prompt))), out_cache_loc=slots,
                     extend_lens=[len(prompt)], kv_indices=[slots], logits_indices=[len(prompt) - 1])
    runner.forward(ForwardBatch.from_step(step, runner.device))


def test_replayed_decode_steps_equal_eager_ones(runner: ModelRunner) -> None:
    """Requests of different lengths decode through the graphs, batches padded to the captured sizes and keys to
    their buckets (crossing 256 keys), and give the eager step's logits; the pad slot takes the padding rows'
    writes, so no request's KV changes under it."""
    graphs = DecodeGraphs(runner, max_bs=6, pad_slot=runner.pad_slot, graph_cls=EagerGraph)
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 40, 254]
    slots = [list(range(1000 * b, 1000 * b + n)) for b, n in enumerate(lengths)]
    for prompt_slots in slots:
        _prefill(runner, torch.randint(0, 1000, (len(prompt_slots),), generator=gen).tolist(), prompt_slots)
    prompts = torch.tensor([x for s in slots for x in s])
    kv = runner.kv_cache
    before = kv.k[:, prompts].clone(), kv.v[:, prompts].clone()
    for step_no in range(12):
        batch = slots[: 1 + step_no % 3]  # 1, 2, 3 requests: padded to 1, 2 and 4 rows
        for s in batch:
            s.append(s[-1] + 1)
        step = _decode_step(torch.randint(0, 1000, (len(batch),), generator=gen).tolist(), batch)
        assert graphs.fits(step)
        replayed = graphs.run(step).clone()
        eager = runner.forward(ForwardBatch.from_step(step, runner.device))  # rewrites the same K and V
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    # the padding rows wrote into the pad slot only: the prompts' K and V are as the prefill left them
    assert torch.equal(kv.k[:, prompts], before[0]) and torch.equal(kv.v[:, prompts], before[1])
    assert len(slots[2]) > 256  # the third request crossed into the 512-key bucket
    assert {keys for _, keys in graphs.graphs} == {256, 512}
    assert {bs for bs, _ in graphs.graphs} <= {1, 2, 4}
    assert graphs.replays == 12


def test_steps_the_graphs_do_not_take(runner: ModelRunner) -> None:
    graphs = DecodeGraphs(runner, max_bs=2, pad_slot=runner.pad_slot, graph_cls=EagerGraph)
    decode = _decode_step([1, 2], [[0, 1], [10, 11]])
    assert graphs.fits(decode)
    assert not graphs.fits(_decode_step([1, 2, 3], [[0, 1], [10, 11], [20, 21]]))  # over --cuda-graph-max-bs
    mixed = StepInput(input_ids=[1, 2, 3], positions=[0, 1, 1], out_cache_loc=[0, 1, 11], extend_lens=[2, 1],
                      kv_indices=[[0, 1], [10, 11]], logits_indices=[1, 2])
    assert not graphs.fits(mixed)  # a prefill in the step
    verify = StepInput(input_ids=[1], positions=[1], out_cache_loc=[1], extend_lens=[1], kv_indices=[[0, 1]],
                       logits_indices=[0], hidden_indices=[0])
    assert not graphs.fits(verify)  # hidden states asked for
    too_long = _decode_step([1], [list(range(graphs.max_keys + 1))])
    assert not graphs.fits(too_long)


def test_engine_decodes_the_same_tokens_through_the_graphs(tiny_llama) -> None:
    """The runner's own dispatch: greedy text with every decode step replayed equals the eager text."""
    from servelm.entrypoints.engine import Engine

    path, _ = tiny_llama
    params = {"max_new_tokens": 24, "temperature": 0.0}
    prompts = ["Hello there", "One two three four five six", "A"]
    engine = Engine(model_path=str(path), max_total_tokens=4096)
    try:
        eager = [o["output_ids"] for o in engine.generate(prompts, params)]
        runner = engine.scheduler.runner
        runner.decode_graphs = DecodeGraphs(runner, 4, runner.pad_slot, graph_cls=EagerGraph)
        replayed = [o["output_ids"] for o in engine.generate(prompts, params)]
        assert runner.decode_graphs.replays >= 20
    finally:
        engine.shutdown()
    assert replayed == eager


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_device_and_dtype_defaults_with_cuda(fake_cuda: None) -> None:
    cuda = resolve_device("auto")
    assert cuda == torch.device("cuda")
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda, False) == "bfloat16"
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_requested_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="--device cuda was requested but no CUDA device is available"):
        resolve_device("cuda")


def test_what_cuda_refuses_and_what_it_dequantises(caplog: pytest.LogCaptureFixture) -> None:
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError, match="--enable-deterministic-inference runs on the CPU only"):
        check_device_support(ServerArgs(enable_deterministic_inference=True), cuda)
    check_device_support(ServerArgs(enable_deterministic_inference=True), torch.device("cpu"))
    check_device_support(ServerArgs(), cuda)
    with pytest.raises(ConfigError, match="needs float32 compute on the CPU"):
        resolve_quantization("q8_0", "gguf", torch.bfloat16, cuda)
    with caplog.at_level(logging.INFO, logger="servelm.model_loader.quantization"):
        policy = resolve_quantization("auto", "gguf", torch.bfloat16, cuda)
    assert not policy.quantized
    assert "dequantised to bfloat16 on cuda" in caplog.text


def test_no_cpu_kernel_is_built_or_loaded_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from servelm.kernels import build

    def refuse() -> bool:
        raise AssertionError("the CPU kernels were asked for on CUDA")

    monkeypatch.setattr(build, "load_quant_ops", refuse)
    choice = KernelChoice.resolve(False, torch.device("cuda"))
    assert (choice.fused, choice.quant, choice.deterministic) == (False, "torch", False)


def test_step_token_budget_by_device() -> None:
    assert ServerArgs().step_token_budget("cpu") == 512
    assert ServerArgs().step_token_budget("cuda") == 8192
    assert ServerArgs(chunked_prefill_size=2048).step_token_budget("cuda") == 2048
    with pytest.raises(ConfigError, match="--chunked-prefill-size must be >= 1, got 0"):
        ServerArgs(chunked_prefill_size=0)


def test_cuda_graph_flags() -> None:
    assert ServerArgs().cuda_graph_max_bs is None and not ServerArgs().disable_cuda_graph
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs must be >= 1, got 0"):
        ServerArgs(cuda_graph_max_bs=0)


def test_a_failed_capture_leaves_decode_eager(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A capture that fails on the GPU costs the graphs, not the server: one warning, every step eager."""
    import servelm.model_executor.cuda_graph_runner as cuda_graph_runner

    class Broken:
        def __init__(self, *args: object) -> None:
            pass

        def capture(self) -> None:
            raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(cuda_graph_runner, "DecodeGraphs", Broken)
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    with caplog.at_level(logging.WARNING, logger="servelm.model_executor.model_runner"):
        assert runner._capture_decode_graphs() is None
    assert runner.decode_graphs_error == "RuntimeError: operation not permitted when stream is capturing"
    assert "could not be captured (RuntimeError: operation not permitted" in caplog.text
    monkeypatch.setattr(runner, "device", torch.device("cpu"))
    assert runner.model_info()["cuda_graph_error"].startswith("RuntimeError")
    monkeypatch.setattr(runner, "decode_graphs_error", None)
