"""SGLang's native endpoints and the server's operations: /generate, tokenize/detokenize, /health_generate,
/model_info, /server_info, /flush_cache, /abort_request."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import Response

from servelm import __version__
from servelm.entrypoints.http_common import ApiError, bad, error_response
from servelm.entrypoints.openai_protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from servelm.entrypoints.serving_base import OpenAIServing
from servelm.entrypoints.streaming import Accumulated, ClientGone, collect, sse, stream_events
from servelm.managers.tokenizer_manager import (
    QueueFullError,
    SchedulerUnavailableError,
    tokenizer_display_path,
)
from servelm.sampling_params import SamplingParams, SamplingParamsError, token_ids_error, top_logprobs_error

_SAMPLING_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_SAMPLING_ADAPTER = pydantic.TypeAdapter(SamplingParams)


def native_sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a native request's dict, with 400s naming the field for unknown keys or bad types."""
    data = dict(raw)
    for key in data:
        if key not in _SAMPLING_FIELDS:
            raise bad(f"sampling_params: unknown sampling parameter '{key}'", f"sampling_params.{key}")
    for name in ("stop", "stop_regex"):
        if isinstance(data.get(name), str):
            data[name] = [data[name]]
    try:
        params = _SAMPLING_ADAPTER.validate_python(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first.get("loc") else "sampling_params"
        raise bad(f"sampling_params.{name}: {first['msg']}", f"sampling_params.{name}") from None
    for name in _SAMPLING_FIELDS:
        value = getattr(params, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(f"sampling_params.{name}: must be a finite number, got {value}", f"sampling_params.{name}")
    return params


class ServingNative(OpenAIServing):
    """The native endpoints."""

    def native_prompts(self, req: GenerateRequest) -> tuple[list[list[int]], str, bool]:
        """(prompts, the field they came from, whether it was a batch) of a /generate request, checked."""
        if (req.text is None) == (req.input_ids is None):
            raise bad("give exactly one of text or input_ids", "text")
        if req.text is not None:
            batch = isinstance(req.text, list)
            prompts = [self.manager.encode(t) for t in (req.text if batch else [req.text])]  # type: ignore[union-attr]
            param = "text"
        else:
            ids_in = req.input_ids or []
            batch = bool(ids_in) and isinstance(ids_in[0], list)
            prompts = [list(p) for p in ids_in] if batch else [list(ids_in)]  # type: ignore[arg-type]
            param = "input_ids"
        if not prompts:
            raise bad(f"{param} must not be empty", param)
        for ids in prompts:
            self.check_ids(ids, param)
        return prompts, param, batch

    def native_params(self, req: GenerateRequest, prompts: list[list[int]]) -> SamplingParams:
        """The sampling params of a /generate request, with SGLang's top-level logprob options applied."""
        params = native_sampling_params(req.sampling_params)
        error = top_logprobs_error(req.top_logprobs_num, "top_logprobs_num")
        if error:
            raise bad(error, "top_logprobs_num")
        shortest = min(len(p) for p in prompts)
        if not -1 <= req.logprob_start_len < shortest:
            raise bad(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position in [0, {shortest}), "
                      f"got {req.logprob_start_len}", "logprob_start_len")
        if req.return_logprob:
            params.logprobs = True
            params.top_logprobs = req.top_logprobs_num or params.top_logprobs
            params.prompt_logprobs = params.prompt_logprobs or req.logprob_start_len >= 0
        try:
            params.validate(self.manager.vocab_size)
        except SamplingParamsError as exc:
            name = "max_new_tokens" if exc.param == "max_tokens" else exc.param
            message = str(exc).removeprefix(f"{exc.param}: ")  # grammar errors name their parameter already
            raise bad(f"sampling_params.{name}: {message}", f"sampling_params.{name}") from None
        return params

    async def generate(self, req: GenerateRequest, request: Request) -> Any:
        """POST /generate (SGLang's native API): text or input_ids, one or a batch."""
        self.check_model(None)  # a generative model
        prompts, param, batch = self.native_prompts(req)
        params = self.native_params(req, prompts)
        self.check_context(max(len(p) for p in prompts), params.max_new_tokens, param, "sampling_params.max_new_tokens")
        rid = req.rid or uuid.uuid4().hex
        group = self.submit(prompts, params, rid, req.stream)
        start = max(req.logprob_start_len, 0) if req.return_logprob else 0

        def meta(index: int, acc: Accumulated, with_prompt_logprobs: bool = True) -> dict[str, Any]:
            reason = acc.finish_reason.to_dict() if acc.finish_reason is not None else None
            prompt = prompts[index // params.n]
            out = {"id": group.subs[index].public_id, "finish_reason": reason,
                   "prompt_tokens": acc.prompt_tokens or len(prompt),
                   "completion_tokens": acc.completion_tokens or len(acc.token_ids), "cached_tokens": acc.cached_tokens}
            text = req.return_text_in_logprobs
            if params.logprobs:
                out["output_token_logprobs"], out["output_top_logprobs"] = self.sglang_logprobs(
                    acc.token_ids, acc.logprobs, acc.top_logprobs, text)
            if params.prompt_logprobs and with_prompt_logprobs:
                out["input_token_logprobs"], out["input_top_logprobs"] = self.sglang_logprobs(
                    prompt[start:], (acc.prompt_logprobs or [])[start:], (acc.prompt_top_logprobs or [])[start:], text)
            elif req.return_logprob and with_prompt_logprobs:
                out["input_token_logprobs"], out["input_top_logprobs"] = [], []
            return out

        def item(index: int, acc: Accumulated, with_prompt_logprobs: bool = True) -> dict[str, Any]:
            return {"text": "".join(acc.text), "output_ids": acc.token_ids, "index": index,
                    "meta_info": meta(index, acc, with_prompt_logprobs)}

        def stream() -> AsyncIterator[str]:
            # Cumulative text per chunk, as SGLang's /generate streams it.
            # The prompt's logprobs go once, in the event of the output that carried them.
            return stream_events(group, lambda index, out, acc: iter([
                sse(item(index, acc, with_prompt_logprobs=out.prompt_logprobs is not None))]))

        result = await self.run_or_stream(group, request, stream() if req.stream else None)
        if not isinstance(result, list):
            return result
        items = [item(i, acc) for i, acc in enumerate(result)]
        return items if batch or len(items) > 1 else items[0]

    def sglang_logprobs(self, ids: list[int], lps: list[float | None], tops: list[Any],
                        with_text: bool) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
        """SGLang's token_logprobs and top_logprobs of `ids`: [logprob, token_id, text or None] each (the
        first prompt token's logprob is None); a token without alternatives has None for them."""
        def entry(lp: float | None, tid: int) -> list[Any]:
            return [lp, tid, self.manager.token_text(tid) if with_text else None]

        token_logprobs = [entry(lps[k] if k < len(lps) else None, tid) for k, tid in enumerate(ids)]
        top_logprobs = [[entry(lp, t) for t, lp in top] if top else None for top in tops[:len(ids)]]
        return token_logprobs, top_logprobs

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """POST /v1/tokenize: a prompt or chat messages (through the chat template) to token ids."""
        self.check_model(req.model, task=None)
        if (req.prompt is None) == (req.messages is None):
            raise bad("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad("messages must be a non-empty list of messages", "messages")
            try:
                ids = self.manager.chat_prompt_ids([{"role": m.role, "content": m.text()} for m in req.messages],
                                                   req.add_generation_prompt, req.continue_final_message,
                                                   template_kwargs=req.chat_template_kwargs)
            except Exception as exc:
                raise bad(f"messages could not be rendered with the chat template: {exc}", "messages") from None
        else:
            ids = self.manager.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """POST /v1/detokenize: token ids to text."""
        self.check_model(req.model, task=None)
        error = token_ids_error(req.tokens, self.manager.vocab_size, "tokens") if req.tokens else None
        if error:
            raise bad(error, "tokens")
        return {"prompt": self.manager.decode(req.tokens)}

    async def health_generate(self, request: Request) -> Response:
        """GET /health_generate: 200 once the model generated one token (an embedding server: embedded one
        input)."""
        embeds = self.manager.model_info.get("task") in ("embed", "score")
        params = SamplingParams(max_new_tokens=0 if embeds else 1, temperature=0.0, ignore_eos=True)
        ids = self.manager.encode("Hello", add_special_tokens=True) or [0]
        try:
            group = self.manager.submit([ids], params, f"health-{uuid.uuid4().hex}", False)
            accs = await asyncio.wait_for(collect(group, request), timeout=30)
        except (QueueFullError, SchedulerUnavailableError, asyncio.TimeoutError, ClientGone) as exc:
            return error_response(503, f"generation health check failed: {type(exc).__name__}: {exc}",
                                  type="service_unavailable")
        if not (accs[0].embedding if embeds else accs[0].token_ids):
            reason = accs[0].finish_reason
            return error_response(503, f"generation health check failed: {reason and reason.to_dict()}",
                                  type="service_unavailable")
        return Response(status_code=200)

    async def model_info(self) -> dict[str, Any]:
        """GET /model_info: what is served."""
        args = self.state.server_args
        return {**self.manager.model_info, "model_path": args.model_path or self.manager.model_info.get("model_path"),
                "tokenizer_path": tokenizer_display_path(args), "served_model_name": self.state.model_name,
                "is_generation": (self.manager.model_info.get("task") or "generate") == "generate"}

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info: the scheduler's live state and the server's arguments (API key masked)."""
        info = await self.scheduler_call(self.manager.server_info())
        args = self.state.server_args
        server_args = dataclasses.asdict(args)
        if server_args.get("api_key"):
            server_args["api_key"] = "***"
        model_info = self.manager.model_info
        return {**info, "num_in_flight": self.manager.num_in_flight, "server_args": server_args,
                "context_length": self.max_model_len,
                # At the top level too, where SGLang's router reads the served model's name and paths.
                "served_model_name": self.state.model_name,
                "model_path": args.model_path or model_info.get("model_path"),
                "tokenizer_path": tokenizer_display_path(self.state.server_args),
                # Resident weights of rank 0 and their formats (servelm.model_loader.quantization).
                **{k: self.manager.model_info.get(k) for k in ("weight_bytes", "quantization", "weight_formats")},
                "version": __version__}

    async def scheduler_call(self, coro: Any) -> Any:
        try:
            return await coro
        except SchedulerUnavailableError as exc:
            raise ApiError(503, str(exc), type="service_unavailable") from None

    async def flush_cache(self) -> Any:
        """POST /flush_cache: empty the prefix cache (refused while requests run)."""
        out = await self.scheduler_call(self.manager.flush_cache())
        if not out.success:
            raise bad(f"Cache not flushed: {out.message or 'requests are running'}")
        return {"success": True, "message": "Cache flushed."}

    async def abort_request(self, req: AbortRequest) -> dict[str, Any]:
        """POST /abort_request: abort the request (or one sample of it) with exactly this rid."""
        return {"success": self.manager.abort_request(req.rid)}
