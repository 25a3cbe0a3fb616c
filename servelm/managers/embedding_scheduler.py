"""The scheduler of an embedding server: inputs wait in arrival order, and each step embeds as many as fit in
the token budget in one forward (many small inputs from many requests share a batch; one input longer than
the budget runs alone). No KV cache, no decoding: an input's output is its embedding, and it is done.

It speaks the scheduler loop's interface (add_request, abort_request, step, has_work, server_info,
model_info, flush_cache, shutdown, stats, last_step_tokens), so the scheduler process and its ZMQ protocol
are the generative server's. Torch-free: the runner does the forward.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from servelm.managers.io_struct import FinishReason, GenerateReq, TokenOut
from servelm.sampling_params import input_length_error, token_ids_error


class EmbeddingModel(Protocol):
    def embed(self, seqs: list[list[int]], token_types: list[list[int]] | None = None) -> list[str]: ...

    def model_info(self) -> dict[str, Any]: ...


@dataclass
class _Waiting:
    rid: str
    input_ids: list[int]
    arrived: float
    token_types: list[int] | None = None


class EmbeddingScheduler:
    def __init__(self, runner: EmbeddingModel, max_batch_tokens: int, max_context_len: int, vocab_size: int,
                 max_batch_inputs: int = 256, on_shutdown: Any = None) -> None:
        self.runner = runner
        self.tokenizer = getattr(runner, "tokenizer", None)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_inputs = max_batch_inputs
        self.max_context_len = max_context_len
        self.vocab_size = vocab_size
        self.on_shutdown = on_shutdown
        self.waiting: deque[_Waiting] = deque()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "aborted": 0, "batches": 0}
        self.last_step_tokens = 0

    def add_request(self, req: GenerateReq) -> None:
        """Queue one input; ValueError when it can never be embedded (the API checks the same first)."""
        if not req.input_ids:
            raise ValueError("an input to embed needs at least one token")
        if req.sampling_params.get("max_new_tokens") or req.label_token_ids:
            raise ValueError("this is an embedding model: it embeds inputs (POST /v1/embeddings) and does not "
                             "generate or score")
        error = token_ids_error(req.input_ids, self.vocab_size) or input_length_error(
            len(req.input_ids), self.max_context_len)
        if error:
            raise ValueError(error)
        types = req.token_type_ids
        if types is not None and (len(types) != len(req.input_ids) or any(t not in (0, 1) for t in types)):
            raise ValueError("token_type_ids must give 0 or 1 for every input token")
        self.waiting.append(_Waiting(req.rid, list(req.input_ids), time.perf_counter(), types))
        self.stats["prompt_tokens"] += len(req.input_ids)

    def abort_request(self, rid: str) -> list[TokenOut]:
        gone = [w for w in self.waiting if w.rid == rid]
        for w in gone:
            self.waiting.remove(w)
            self.stats["aborted"] += 1
        return [self._out(w, None, FinishReason.abort()) for w in gone]

    def has_work(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[TokenOut]:
        """Embed the oldest inputs that fit in the budget (at least one) in one forward."""
        batch: list[_Waiting] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_batch_inputs:
            n = len(self.waiting[0].input_ids)
            if batch and tokens + n > self.max_batch_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        self.last_step_tokens = tokens
        if not batch:
            return []
        started = time.perf_counter()
        try:
            types = [w.token_types or [0] * len(w.input_ids) for w in batch] \
                if any(w.token_types for w in batch) else None
            vectors = self.runner.embed([w.input_ids for w in batch], types)
        except Exception as exc:  # never end the loop: the batch's requests fail, the server serves on
            self.stats["aborted"] += len(batch)
            return [self._out(w, None, FinishReason.abort(f"embedding failed: {type(exc).__name__}: {exc}",
                                                          internal=True)) for w in batch]
        self.stats["batches"] += 1
        self.stats["finished"] += len(batch)
        took = time.perf_counter() - started
        return [self._out(w, vec, FinishReason.stop(), started, took) for w, vec in zip(batch, vectors, strict=True)]

    def _out(self, w: _Waiting, vector: str | None, reason: FinishReason, started: float | None = None,
             took: float = 0.0) -> TokenOut:
        timings = None if started is None else {"queue": started - w.arrived, "prefill": took, "decode": 0.0}
        return TokenOut(rid=w.rid, token_ids=[], text="", finish_reason=reason, prompt_tokens=len(w.input_ids),
                        completion_tokens=0, cached_tokens=0, embedding=vector, timings=timings)

    def flush_cache(self) -> bool:
        return True  # nothing is cached

    def server_info(self) -> dict[str, Any]:
        return {"num_running": 0, "num_waiting": len(self.waiting), "kv_total_tokens": 0, "kv_free_tokens": 0,
                "kv_cached_tokens": 0, "kv_in_use_tokens": 0, "kv_integrity_ok": True, "kv_integrity_error": None,
                "cache_hit_rate": 0.0, "max_batch_tokens": self.max_batch_tokens,
                **{f"{k}_total": v for k, v in self.stats.items()}}

    def model_info(self) -> dict[str, Any]:
        return {**self.runner.model_info(), "max_context_length": self.max_context_len, "vocab_size": self.vocab_size}

    def shutdown(self) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
