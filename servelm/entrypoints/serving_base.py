"""What every OpenAI-style endpoint does with a request, whatever its shape (as vLLM's `OpenAIServing`):
check the model name and token ids, build and validate the sampling params (400s naming the field),
submit to the scheduler (429 when full), then collect the outputs or hand back a stream.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from servelm.entrypoints.http_common import ApiError, bad
from servelm.entrypoints.openai_protocol import ResponseFormat
from servelm.entrypoints.streaming import ClientGone, collect, error_of
from servelm.managers.tokenizer_manager import (
    CapacityError,
    DuplicateRequestIdError,
    QueueFullError,
    RequestGroup,
)
from servelm.sampling_params import SamplingParams, SamplingParamsError, context_length_error, token_ids_error

if TYPE_CHECKING:
    from servelm.entrypoints.http_server import ServerState


def json_schema_of(fmt: ResponseFormat | None) -> str | None:
    """The JSON schema (as a string) that OpenAI's response_format asks the output to follow, if any."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}' if fmt.schema_ is None else json.dumps(fmt.schema_)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad("response_format: type json_schema needs json_schema.schema", "response_format")
    return json.dumps(fmt.json_schema.schema_)



class OpenAIServing:
    """The shared half of the endpoints; `ServingChat`, `ServingCompletions` and `ServingNative` add theirs."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.manager = state.manager

    def check_model(self, name: str | None) -> None:
        if name and name != self.state.model_name:
            raise ApiError(404, f"The model `{name}` does not exist. This server serves `{self.state.model_name}`.",
                           param="model", code="model_not_found")

    def check_ids(self, ids: list[int], param: str) -> None:
        error = token_ids_error(ids, self.manager.vocab_size, param)
        if error:
            raise bad(error, param)

    def check_context(self, prompt_len: int, max_new_tokens: int | None, prompt_param: str,
                      limit_param: str) -> None:
        """A 400 when the prompt (with max_new_tokens, when known) does not fit the model's context."""
        error = context_length_error(prompt_len, max_new_tokens, self.manager.context_length, prompt_param,
                                     limit_param)
        if error:
            too_long = max_new_tokens is None or prompt_len >= self.manager.context_length
            raise bad(error, prompt_param if too_long else limit_param)

    def sampling_params(self, req: Any, max_tokens: int | None, max_tokens_param: str, prompt_lens: list[int],
                        prompt_param: str, logprobs: bool, top_logprobs: int,
                        json_schema: str | None = None, schema_param: str = "response_format") -> SamplingParams:
        """SamplingParams of an OpenAI request; `json_schema` (from `schema_param`) overrides response_format."""
        ctx = self.manager.context_length
        longest = max(prompt_lens)
        self.check_context(longest, None, prompt_param, max_tokens_param)
        if max_tokens is None:
            max_tokens = (ctx - longest) if ctx else 16
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "n": req.n, "seed": req.seed,
                              "ignore_eos": req.ignore_eos, "min_new_tokens": req.min_tokens,
                              "skip_special_tokens": req.skip_special_tokens, "logprobs": logprobs,
                              "top_logprobs": top_logprobs, "stop": req.stop or [],
                              "stop_token_ids": req.stop_token_ids or []}
        for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty", "regex", "logit_bias"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        kw["json_schema"] = json_schema if json_schema is not None else json_schema_of(req.response_format)
        params = SamplingParams(**kw)
        try:
            params.validate(self.manager.vocab_size)
        except SamplingParamsError as exc:
            param = {"max_tokens": max_tokens_param, "json_schema": schema_param}.get(exc.param, exc.param)
            raise bad(str(exc).replace(exc.param, param, 1), param) from None
        self.check_context(longest, params.max_new_tokens, prompt_param, max_tokens_param)
        return params

    def submit(self, prompts: list[list[int]], params: SamplingParams, rid: str, stream: bool) -> RequestGroup:
        try:
            return self.manager.submit(prompts, params, rid, stream)
        except QueueFullError as exc:
            raise ApiError(429, str(exc), type="rate_limit_exceeded", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except DuplicateRequestIdError as exc:
            raise bad(str(exc), "rid") from None
        except CapacityError as exc:
            raise bad(str(exc), "n") from None

    async def run_or_stream(self, group: RequestGroup, request: Request, stream_gen: Any) -> Any:
        if stream_gen is not None:
            return StreamingResponse(stream_gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            accs = await collect(group, request)
        except ClientGone:
            return Response(status_code=499)
        for acc in accs:
            err = error_of(acc)
            if err is not None:
                raise err
        return accs
