"""Decode steps replayed from captured CUDA graphs (SGLang's `CudaGraphRunner`, vLLM's `CUDAGraphWrapper`).

At batch 1 on a GPU a decode step of a small model is a few hundred tiny kernels, each launched from Python:
the launches, not the weights' bytes, set the pace. A CUDA graph records the model's layers once and replays
them with one call, reading its inputs from fixed ("static") device buffers.

What is captured: the decoder stack of a pure decode step (every request adds one token), from the token ids to
the final norm, for each (batch size, key-length bucket) pair as a step first needs it. The LM head, the
logits and the sampler run after the replay, on the real rows only.

Static shapes, and how a step fits them:
* the batch is padded up to the next captured size (`capture_sizes`); a padding row decodes token 0 at
  position 0, writes its K and V into `pad_slot` (a KV page the allocator never hands out) and attends to
  that slot alone;
* the attention's key length is padded up to a power of two from `MIN_KEY_BUCKET` (servelm's CUDA decode
  attention is torch's gather + bmm, whose shapes follow the longest context of the batch); the padded keys
  repeat the row's first slot and are masked to -inf, as in eager mode.

So the captured arithmetic is the eager decode path's, on the same shapes the eager path would run for the
padded batch. The inputs go to the device as one host-to-device copy of one pinned buffer per step.

`EagerGraph` replays by running the recorded function again: the same protocol on any device, so the
padding, bucketing and buffer handling are tested on the CPU (tests/models/test_cuda_graph_runner.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from servelm.managers.schedule_batch import StepInput
from servelm.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

MIN_KEY_BUCKET = 256
MAX_CAPTURE_BS = 256
# SGLang's spacing: every size up to 8 that is a power of two, then steps that grow with the batch.
_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def capture_sizes(max_bs: int) -> list[int]:
    """The batch sizes captured for `--cuda-graph-max-bs max_bs` (max_bs itself always among them)."""
    max_bs = max(1, min(max_bs, MAX_CAPTURE_BS))
    return [s for s in _SIZES if s < max_bs] + [max_bs]


def key_bucket(length: int) -> int:
    """The padded key length of a step whose longest context is `length` tokens."""
    bucket = MIN_KEY_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


class TorchCudaGraph:
    """One `torch.cuda.CUDAGraph`, captured after a warm-up run on a side stream (torch's recipe); every graph
    of a runner shares one memory pool, as their replays never overlap."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # lazy initialisations (cuBLAS handles, workspaces) happen here, not during capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """The graph protocol without a GPU: `replay` runs the recorded function again and writes its result into
    the tensor `capture` returned (as a replay refills a graph's output)."""

    def __init__(self, pool: Any = None) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None
        self.out.copy_(self.fn())


class DecodeGraphs:
    """The captured decode steps of one model runner (TP 1).

    `runner` gives `model` (with `.model`, `.lm_head`, `.logits_processor`), `kv_cache`, `device` and
    `max_context_len`; `pad_slot` is a KV slot no request ever owns.
    """

    def __init__(self, runner: Any, max_bs: int, pad_slot: int, graph_cls: type = TorchCudaGraph) -> None:
        self.runner = runner
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.pad_slot = pad_slot
        self.max_keys = key_bucket(runner.max_context_len)
        self.graph_cls = graph_cls
        self.pool = torch.cuda.graph_pool_handle() if graph_cls is TorchCudaGraph else None
        device = runner.device
        # One int64 buffer: ids, positions, out slots, key lengths (max_bs each), then the [bs, keys] slots.
        self._head = 4 * self.max_bs
        size = self._head + self.max_bs * self.max_keys
        self.buffer = torch.zeros(size, dtype=torch.long, device=device)
        self.staging = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._host = self.staging.numpy()
        # Set when the last upload has left the pinned buffer: the next fill waits for it (a step without
        # sampled rows reads nothing back, so nothing else would wait).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.replays = 0
        self.capture_seconds = 0.0

    def describe(self) -> dict[str, Any]:
        return {"cuda_graph_max_bs": self.max_bs, "cuda_graphs_captured": len(self.graphs),
                "cuda_graph_capture_seconds": round(self.capture_seconds, 2)}

    def fits(self, step: StepInput) -> bool:
        """Whether `step` is a pure decode step these graphs run: every request adds one token, each has its
        logits row in order, none asks for hidden states, and the batch and contexts are within the captures."""
        n = len(step.extend_lens)
        return (0 < n <= self.max_bs and not step.hidden_indices and all(e == 1 for e in step.extend_lens)
                and step.logits_indices == list(range(n))
                and max(len(k) for k in step.kv_indices) <= self.max_keys)

    @torch.inference_mode()
    def capture(self, keys: int = MIN_KEY_BUCKET) -> None:
        """Capture every batch size for one key bucket now (start-up); other buckets are captured on first use."""
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            self._graph(bs, keys)

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """fp32 logits [n, vocab] of a step that `fits`."""
        n = len(step.extend_lens)
        bs = next(s for s in self.sizes if s >= n)
        keys = key_bucket(max(len(k) for k in step.kv_indices))
        graph, hidden = self._graph(bs, keys)  # first: a capture pads the buffers
        self._fill(step, bs, keys)
        self._upload(bs, keys)
        graph.replay()
        self.replays += 1
        model = self.runner.model
        return model.logits_processor(hidden[:n], model.lm_head)

    # ------------------------------------------------------------------ internals
    def _views(self, bs: int, keys: int) -> tuple[torch.Tensor, ...]:
        b, m = self.buffer, self.max_bs
        kv = b[self._head: self._head + bs * keys].view(bs, keys)
        return b[0:bs], b[m:m + bs], b[2 * m:2 * m + bs], b[3 * m:3 * m + bs], kv

    def _fill(self, step: StepInput, bs: int, keys: int) -> None:
        """The step's inputs, padded to (bs, keys), into the pinned host buffer."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        h, m, n = self._host, self.max_bs, len(step.extend_lens)
        h[0:n] = step.input_ids
        h[m:m + n] = step.positions
        h[2 * m:2 * m + n] = step.out_cache_loc
        lens = h[3 * m:3 * m + bs]
        kv = h[self._head: self._head + bs * keys].reshape(bs, keys)
        for b, slots in enumerate(step.kv_indices):
            lens[b] = len(slots)
            kv[b, : len(slots)] = slots
            kv[b, len(slots):] = slots[0]
        self._pad(n, bs, keys)

    def _pad(self, n: int, bs: int, keys: int) -> None:
        """Rows n..bs-1 of the host buffer as padding: token 0 at position 0, its K and V into the pad slot, which
        is also the one key it attends to."""
        h, m = self._host, self.max_bs
        h[n:bs] = 0
        h[m + n:m + bs] = 0
        h[2 * m + n:2 * m + bs] = self.pad_slot
        h[3 * m + n:3 * m + bs] = 1
        h[self._head + n * keys: self._head + bs * keys] = self.pad_slot

    def _upload(self, bs: int, keys: int) -> None:
        size = self._head + bs * keys
        self.buffer[:size].copy_(self.staging[:size], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def _graph(self, bs: int, keys: int) -> tuple[Any, torch.Tensor]:
        found = self.graphs.get((bs, keys))
        if found is not None:
            return found
        t0 = time.perf_counter()
        if self._uploaded is not None:
            self._uploaded.synchronize()
        # Padding everywhere while capturing: the warm-up and the capture write only the pad slot's K and V.
        self._pad(0, bs, keys)
        self._upload(bs, keys)
        ids, positions, out_loc, lens, kv_index = self._views(bs, keys)
        model, kv_cache = self.runner.model, self.runner.kv_cache

        def forward() -> torch.Tensor:
            fb = ForwardBatch(input_ids=ids, positions=positions, out_cache_loc=out_loc, extend_lens=[1] * bs,
                              seq_lens=[keys] * bs, kv_indices=[], logits_indices=torch.arange(bs, device=ids.device),
                              kv_cache=kv_cache)
            fb.decode_reqs = list(range(bs))
            fb.decode_kv_index, fb.decode_lens = kv_index, lens
            fb.decode_bias = ForwardBatch.padding_bias(lens, keys)
            with torch.inference_mode():
                return model.model(fb)

        graph = self.graph_cls(self.pool)
        hidden = graph.capture(forward)
        self.graphs[(bs, keys)] = (graph, hidden)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        logger.debug("Captured the decode step of %d requests over %d keys", bs, keys)
        return graph, hidden

