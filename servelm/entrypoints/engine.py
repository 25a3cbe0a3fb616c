"""The offline Engine: the scheduler driven in-process, no server, no IPC.

    engine = Engine(model_path="...")            # or Engine(ServerArgs(...)); no path = embedded default
    engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from servelm.config import ServerArgs
from servelm.cpu_threads import ThreadGovernor, configure_cpu_threads
from servelm.managers.engine_core import build_scheduler
from servelm.managers.io_struct import GenerateReq, OutputAccumulator, TokenOut
from servelm.sampling_params import SamplingParams


def _result(acc: OutputAccumulator, want_logprobs: bool) -> dict[str, Any]:
    """An offline request's result: text, ids, finish reason and usage (and logprobs when asked)."""
    assert acc.finish_reason is not None
    d: dict[str, Any] = {
        "text": acc.full_text, "output_ids": acc.token_ids, "finish_reason": acc.finish_reason.to_dict(),
        "usage": {"prompt_tokens": acc.prompt_tokens, "completion_tokens": acc.completion_tokens,
                  "cached_tokens": acc.cached_tokens},
    }
    if want_logprobs:
        d["logprobs"] = acc.logprobs
        d["top_logprobs"] = [[tuple(x) for x in t] for t in acc.top_logprobs]
    if acc.prompt_logprobs is not None:
        d["prompt_logprobs"] = acc.prompt_logprobs
        d["prompt_top_logprobs"] = [None if t is None else [tuple(x) for x in t]
                                    for t in acc.prompt_top_logprobs or []]
    return d


class Engine:
    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any) -> None:
        if server_args is None:
            server_args = ServerArgs(**kwargs)
        elif kwargs:
            server_args = server_args.replace(**kwargs)
        if server_args.dp_size > 1:
            raise ValueError(f"--dp-size {server_args.dp_size}: the offline Engine runs one replica; data-parallel "
                             "replicas are the server's (servelm serve --dp-size), or run one Engine per process")
        self.server_args = server_args
        # Threads of this process and of the TP workers it spawns (they inherit the environment).
        self.cpu_threads = configure_cpu_threads(server_args.num_threads,
                                                 processes=server_args.tp_ranks_per_node)
        self.scheduler = build_scheduler(server_args)
        # Fewer model threads while other processes want the CPUs (ticked every step).
        self.governor = ThreadGovernor.for_process(server_args.num_threads,
                                                   processes=server_args.tp_ranks_per_node,
                                                   deterministic=server_args.enable_deterministic_inference)
        self.tokenizer = self.scheduler.tokenizer
        self._ids = itertools.count()

    def _make_reqs(self, prompt: str | list[str] | None, sampling_params: dict | list[dict] | None,
                   input_ids: list[int] | list[list[int]] | None) -> tuple[bool, list[tuple[GenerateReq, bool]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and input_ids and isinstance(input_ids[0], int))
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            token_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        else:
            token_lists = [input_ids] if single else list(input_ids)  # type: ignore[list-item]
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(token_lists)
        if len(params_list) != len(token_lists):
            raise ValueError("sampling_params must be one dict or one per prompt")
        reqs = []
        for ids, sp in zip(token_lists, params_list):
            params = SamplingParams.from_dict(dict(sp or {}))
            params.validate(self.scheduler.vocab_size)
            base = f"req{next(self._ids)}"
            for i in range(params.n):
                rid = base if params.n == 1 else f"{base}-{i}"
                reqs.append((GenerateReq(rid, list(ids), params.to_dict(), stream=False, sample_index=i),
                             params.logprobs))
        return bool(single), reqs

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 stream: bool = False) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (-> dict, or list of n dicts when n > 1) or a batch (-> flat list).

        With stream=True (one prompt, n=1) returns an iterator of dicts whose "text" and "output_ids"
        are the increments, the last one carrying finish_reason and usage.
        """
        single, reqs = self._make_reqs(prompt, sampling_params, input_ids)
        if stream:
            if len(reqs) != 1:
                raise ValueError("stream=True supports one prompt with n=1")
            return self._stream(reqs[0][0])
        results = {}
        for req, _ in reqs:
            self.scheduler.add_request(req)
            results[req.rid] = OutputAccumulator()
        pending = set(results)
        try:
            while pending:
                for out in self.step():
                    results[out.rid].add(out)
                    if out.finish_reason is not None:
                        pending.discard(out.rid)
        finally:
            for rid in pending:
                self.scheduler.abort_request(rid)
        dicts = [_result(results[req.rid], want) for req, want in reqs]
        if single:
            return dicts[0] if len(dicts) == 1 else dicts
        return dicts

    def embed(self, prompt: str | list[str] | None = None,
              input_ids: list[int] | list[list[int]] | None = None) -> list[float] | list[list[float]]:
        """An embedding model's vectors (vLLM's `LLM.embed`): one text (-> one vector) or a list (-> a list),
        tokenized with the model's special tokens; or token ids. All inputs share the scheduler's forwards."""
        import base64

        import numpy as np

        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if self.scheduler.model_info().get("task") != "embed":
            raise ValueError("this engine runs a generative model: Engine(model_path=..., is_embedding=True) "
                             "embeds")
        single = isinstance(prompt, str) or (input_ids is not None and bool(input_ids)
                                             and isinstance(input_ids[0], int))
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            token_lists = [list(self.tokenizer.encode(t, add_special_tokens=True)) for t in texts]
        else:
            token_lists = [input_ids] if single else list(input_ids)  # type: ignore[list-item]
        rids = [f"embed{next(self._ids)}" for _ in token_lists]
        vectors: dict[str, list[float]] = {}
        try:
            for rid, ids in zip(rids, token_lists):
                self.scheduler.add_request(GenerateReq(rid, list(ids), {"max_new_tokens": 0}))
            while len(vectors) < len(rids):
                for out in self.step():
                    if out.finish_reason is None:
                        continue
                    if out.embedding is None:
                        raise RuntimeError(f"input {rids.index(out.rid)} was not embedded: "
                                           f"{out.finish_reason.message}")
                    vectors[out.rid] = np.frombuffer(base64.b64decode(out.embedding), dtype="<f4").tolist()
        finally:
            for rid in set(rids) - set(vectors):
                self.scheduler.abort_request(rid)
        result = [vectors[rid] for rid in rids]
        return result[0] if single else result

    def _stream(self, req: GenerateReq) -> Iterator[dict[str, Any]]:
        req.stream = True
        self.scheduler.add_request(req)
        done = False
        try:
            while not done:
                for out in self.step():
                    if out.rid != req.rid:
                        continue
                    done = out.finish_reason is not None
                    chunk: dict[str, Any] = {"text": out.text, "output_ids": out.token_ids, "finish_reason":
                                             out.finish_reason.to_dict() if out.finish_reason else None}
                    if out.prompt_logprobs is not None:
                        chunk["prompt_logprobs"] = out.prompt_logprobs
                        chunk["prompt_top_logprobs"] = out.prompt_top_logprobs
                    if done:
                        chunk["usage"] = {"prompt_tokens": out.prompt_tokens,
                                          "completion_tokens": out.completion_tokens,
                                          "cached_tokens": out.cached_tokens}
                    yield chunk
        finally:
            if not done:
                self.scheduler.abort_request(req.rid)

    def step(self) -> list[TokenOut]:
        """One scheduler step (the thread governor, if any, adapts the thread count first)."""
        if self.governor is not None:
            self.governor.tick()
        return self.scheduler.step()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def server_info(self) -> dict[str, Any]:
        return self.scheduler.server_info()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (a TP=1 engine has nothing running)."""
        self.scheduler.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
