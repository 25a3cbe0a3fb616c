"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) and its native endpoints.

Process layout: this process runs the event loop, tokenisation and chat
templates (`TokenizerManager`); the model runs in one scheduler process
(`run_scheduler_process`, multiprocessing "spawn") reached over ZMQ ipc
sockets in a private temp dir. The HTTP port opens at once: `/health`
answers 503 until the scheduler has loaded the model, then 200.

Every client mistake is a 4xx in the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}`; 503 only while starting or
stopping; 429 (with Retry-After) when too many requests are in flight.

Testing hook: `SERVELM_SCHEDULER_FACTORY=module:attr` in the environment runs
`attr(server_args)` instead of `Scheduler.from_server_args` in the scheduler
process (see `servelm.managers.scheduler_process`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hmac
import json
import logging
import math
import multiprocessing
import multiprocessing.resource_tracker
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from servelm import __version__
from servelm.config import ServerArgs
from servelm.entrypoints.chat_page import is_open_path, mount_chat_page
from servelm.entrypoints.openai_protocol import (
    AbortRequest,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    ErrorDetail,
    ErrorResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseFormat,
    TokenizeRequest,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
    unknown_fields_message,
)
from servelm.entrypoints.tool_calls import (
    ConstrainedCallStream,
    HermesStream,
    plan_tool_calls,
    template_messages,
)
from servelm.managers.io_struct import TokenOut
from servelm.managers.scheduler_process import run_scheduler_process
from servelm.managers.tokenizer_manager import (
    CapacityError,
    DuplicateRequestIdError,
    QueueFullError,
    RequestGroup,
    SchedulerUnavailableError,
    TokenizerManager,
    load_server_tokenizer,
    tokenizer_display_path,
)
from servelm.metrics import ServerMetrics
from servelm.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger("servelm.http_server")

# Paths that answer without an API key and before the scheduler is ready.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# A fault of ours, not of the request: the client gets a 503, not a 400.
_INTERNAL = "internal"
_DISCONNECT_POLL_S = 0.05  # a hung-up client frees its KV within this much
_SCHEDULER_STOP_TIMEOUT_S = 5.0


class ServerError(RuntimeError):
    """The server could not start or stopped on a fault (e.g. the scheduler process failed)."""


class ApiError(Exception):
    """An HTTP error in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON response `{"error": {"message", "type", "param", "code"}}`."""
    body = ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def served_model_name(server_args: ServerArgs) -> str:
    """The model id the API reports and accepts: --served-model-name, else the model path,
    else the default model's file name without its extension."""
    if server_args.served_model_name:
        return server_args.served_model_name
    if server_args.model_path:
        return server_args.model_path
    try:
        from servelm.model_loader.default_model import default_model_path

        return os.path.splitext(os.path.basename(default_model_path()))[0]
    except Exception:
        return "default"


# ------------------------------------------------------------------ state
@dataclass
class ServerState:
    """What the endpoints share: configuration, the tokenizer manager and lifecycle flags."""

    server_args: ServerArgs
    model_name: str
    manager: TokenizerManager
    metrics: ServerMetrics
    ready: bool = False
    shutting_down: bool = False
    stop_signal: int | None = None  # the signal that stops the server, if one did
    started_at: float = field(default_factory=time.monotonic)
    fatal_error: str | None = None
    proc: Any = None  # the scheduler process
    ready_reader: Connection | None = None
    uvicorn_server: uvicorn.Server | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)

    def fail(self, message: str) -> None:
        """Record a fatal fault and make uvicorn stop."""
        logger.error("%s", message)
        self.fatal_error = self.fatal_error or message
        self.shutting_down = True
        self.manager.fail_all(message)
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True


# ------------------------------------------------------- request helpers
def _sse(obj: Any) -> str:
    data = obj.model_dump_json() if isinstance(obj, pydantic.BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


@dataclass
class _Accumulated:
    """Everything one sub-request produced."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    def add(self, out: TokenOut) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.top_logprobs.extend(out.top_logprobs)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason


class _ClientGone(Exception):
    pass


def _finish_reason_str(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else str(reason.get("type"))


def _matched(reason: dict[str, Any] | None) -> int | str | None:
    return None if reason is None else reason.get("matched")


def _error_of(out: TokenOut | _Accumulated) -> ApiError | None:
    """The error a request that the scheduler refused or lost should answer, else None."""
    reason = out.finish_reason
    if not reason or reason.get("type") != "abort" or "message" not in reason:
        return None
    if reason.get(_INTERNAL):
        return ApiError(503, str(reason["message"]), type="service_unavailable")
    produced = out.token_ids if isinstance(out, TokenOut) else out.token_ids
    if produced or reason["message"] == "aborted":
        return None  # a partial result or an /abort_request: reported as finish_reason "abort"
    return _bad(str(reason["message"]))


def _json_schema_of(fmt: ResponseFormat | None) -> str | None:
    """The JSON schema (as a string) that OpenAI's response_format asks the output to follow, if any."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}' if fmt.schema_ is None else json.dumps(fmt.schema_)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise _bad("response_format: type json_schema needs json_schema.schema", "response_format")
    return json.dumps(fmt.json_schema.schema_)


def _stream_error_event(err: ApiError) -> str:
    return _sse(ErrorResponse(error=ErrorDetail(message=err.message, type=err.type, param=err.param, code=err.code)))


async def _stream_events(group: RequestGroup, render: Callable[[int, TokenOut, _Accumulated], Iterator[str]],
                         usage_event: Callable[[list[_Accumulated]], str] | None = None) -> AsyncIterator[str]:
    """The SSE events of a streamed request group, one loop for every endpoint.

    Each output is added to its sub-request's accumulator and handed to `render` (the endpoint's events for
    it); a failed output becomes an error event instead. Then the usage event, if any, and [DONE].
    """
    accs = [_Accumulated() for _ in group.subs]
    async for index, out in group.outputs():
        accs[index].add(out)
        err = _error_of(out)
        if err is not None:
            yield _stream_error_event(err)
            continue
        for event in render(index, out, accs[index]):
            yield event
    if usage_event is not None:
        yield usage_event(accs)
    yield _SSE_DONE


async def _collect(group: RequestGroup, request: Request) -> list[_Accumulated]:
    """Wait for every output of the group; abort it (and raise _ClientGone) if the client hangs up."""
    accs = [_Accumulated() for _ in group.subs]

    async def consume() -> None:
        async for index, out in group.outputs():
            accs[index].add(out)

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                task.result()
                return accs
            if await request.is_disconnected():
                raise _ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _usage(prompt_lens: list[int], accs: list[_Accumulated], n: int) -> UsageInfo:
    # The prompt is counted once per prompt however many samples it has (as OpenAI does).
    prompt_tokens = sum(prompt_lens)
    completion = sum(a.completion_tokens or len(a.token_ids) for a in accs)
    cached = sum(max((a.cached_tokens for a in accs[p * n:(p + 1) * n]), default=0)
                 for p in range(len(prompt_lens)))
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def check_text_only(req: ChatCompletionRequest) -> None:
    """A 400 for what a text-only model cannot take: image/audio/file content parts, audio output."""
    if req.audio is not None or any(m != "text" for m in req.modalities or []):
        raise _bad("This model generates text only: modalities other than 'text' and audio output are not "
                   "supported", "audio" if req.audio is not None else "modalities")
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text":
                    raise _bad(f"messages.{i}.content.{j}: this model takes text only; content of type "
                               f"'{part.type}' (images, audio, files) is not supported", "messages")


# ------------------------------------------------------------- the app
def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over `state` (its lifespan starts/stops the scheduler link)."""
    manager = state.manager
    args = state.server_args

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        manager.start()
        startup = asyncio.create_task(_startup(state))
        try:
            yield
        finally:
            state.shutting_down = True
            state.stop_event.set()
            startup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await startup
            _stop_scheduler(state.proc)
            manager.close()

    app = FastAPI(title="servelm", version=__version__, lifespan=lifespan)

    # ---------------------------------------------------- error handlers
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code,
                              headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # Unknown top-level fields first: a misspelt field is the likely cause of anything else.
        unknown = [str(e["loc"][1]) for e in errors if e.get("type") == "extra_forbidden" and len(e["loc"]) == 2]
        if unknown:
            return error_response(400, unknown_fields_message(unknown), param=unknown[0])
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "invalid_text":  # the whole body was checked: the message has the path
            path = str((first.get("ctx") or {}).get("path", "body"))
            return error_response(400, str(first.get("msg")), param=path.split(".")[0])
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return error_response(400, f"Malformed JSON body: {detail or first.get('msg')}", param="body")
        if not loc:
            msg = "Request body is required" if first.get("type") == "missing" else first.get("msg", "")
            return error_response(400, f"body: {msg} (send a JSON object)", param="body")
        # Union member names (e.g. 'list[int]') are noise for the user: keep the field path.
        path = ".".join(p for p in loc if "[" not in p)
        return error_response(400, f"{path}: {first.get('msg')}", param=loc[0])

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "Internal server error", type="internal_error")

    # A plain ASGI middleware (not BaseHTTPMiddleware) so that client hang-ups still reach
    # streaming responses at once.
    app.add_middleware(_GuardMiddleware, state=state)

    # ------------------------------------------------------- helpers
    def check_model(name: str | None) -> None:
        if name and name != state.model_name:
            raise ApiError(404, f"The model `{name}` does not exist. This server serves `{state.model_name}`.",
                           param="model", code="model_not_found")

    def check_ids(ids: list[int], param: str) -> None:
        if not ids:
            raise _bad(f"{param} must not be empty", param)
        vocab = manager.vocab_size
        for pos, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise _bad(f"{param}: token id {t} at position {pos} is out of range [0, {vocab})", param)

    def sampling_params(req: Any, max_tokens: int | None, max_tokens_param: str, prompt_lens: list[int],
                        prompt_param: str, logprobs: bool, top_logprobs: int,
                        json_schema: str | None = None, schema_param: str = "response_format") -> SamplingParams:
        """SamplingParams of an OpenAI request; `json_schema` (from `schema_param`) overrides response_format."""
        ctx = manager.context_length
        longest = max(prompt_lens)
        if ctx and longest >= ctx:
            raise _bad(f"This model's maximum context length is {ctx} tokens. However, the {prompt_param} has "
                       f"{longest} tokens. Please reduce the length of the {prompt_param}.", prompt_param)
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
        kw["json_schema"] = json_schema if json_schema is not None else _json_schema_of(req.response_format)
        params = SamplingParams(**kw)
        try:
            params.validate(manager.vocab_size)
        except SamplingParamsError as exc:
            param = {"max_tokens": max_tokens_param, "json_schema": schema_param}.get(exc.param, exc.param)
            raise _bad(str(exc).replace(exc.param, param, 1), param) from None
        if ctx and longest + params.max_new_tokens > ctx:
            raise _bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                       f"{longest + params.max_new_tokens} tokens ({longest} in the {prompt_param}, "
                       f"{params.max_new_tokens} in the completion). Please reduce the length of the "
                       f"{prompt_param} or {max_tokens_param}.", max_tokens_param)
        return params

    def submit(prompts: list[list[int]], params: SamplingParams, rid: str, stream: bool) -> RequestGroup:
        try:
            return manager.submit(prompts, params, rid, stream)
        except QueueFullError as exc:
            raise ApiError(429, str(exc), type="rate_limit_exceeded", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except DuplicateRequestIdError as exc:
            raise _bad(str(exc), "rid") from None
        except CapacityError as exc:
            raise _bad(str(exc), "n") from None

    def chat_logprobs(out: TokenOut | _Accumulated) -> ChatLogprobs:
        content = []
        for k, tid in enumerate(out.token_ids[:len(out.logprobs)]):
            text = manager.token_text(tid)
            tops = [TopLogprob(token=manager.token_text(t), logprob=lp, bytes=list(manager.token_text(t).encode()))
                    for t, lp in (out.top_logprobs[k] if k < len(out.top_logprobs) else [])]
            content.append(ChatTokenLogprob(token=text, logprob=out.logprobs[k], bytes=list(text.encode()),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)

    def completion_logprobs(ids: list[int], lps: list[float | None], tops: list[list[tuple[int, float]] | None],
                            offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for k, tid in enumerate(ids):
            text = manager.token_text(tid)
            result.tokens.append(text)
            result.token_logprobs.append(lps[k] if k < len(lps) else None)
            top = tops[k] if k < len(tops) else None
            result.top_logprobs.append(None if top is None else {manager.token_text(t): lp for t, lp in top})
            result.text_offset.append(offset)
            offset += len(text)
        return result

    async def run_or_stream(group: RequestGroup, request: Request, stream_gen: Any) -> Any:
        if stream_gen is not None:
            return StreamingResponse(stream_gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            accs = await _collect(group, request)
        except _ClientGone:
            return Response(status_code=499)
        for acc in accs:
            err = _error_of(acc)
            if err is not None:
                raise err
        return accs

    # ---------------------------------------------------- OpenAI API
    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    def model_card() -> ModelCard:
        return ModelCard(id=state.model_name, root=args.model_path or manager.model_info.get("model_path"),
                         max_model_len=manager.context_length or None)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        if model_id != state.model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist.", type="invalid_request_error",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        check_model(req.model)
        if not req.messages:
            raise _bad("messages must be a non-empty list of messages", "messages")
        if req.top_logprobs and not req.logprobs:
            raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
        check_text_only(req)
        try:
            tools = plan_tool_calls(req.tools, req.tool_choice, args.tool_call_parser,
                                    parallel=req.parallel_tool_calls is not False)
        except ValueError as exc:
            raise _bad(str(exc), "tool_choice") from None
        if tools is not None and req.response_format is not None and req.response_format.type != "text":
            raise _bad("response_format cannot be combined with a tool_choice that calls a tool", "response_format")
        try:
            messages = template_messages(req.messages)
        except ValueError as exc:
            raise _bad(str(exc), "messages") from None
        try:
            ids = manager.chat_prompt_ids(messages, req.add_generation_prompt, req.continue_final_message,
                                          [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                                          req.chat_template_kwargs)
        except Exception as exc:  # jinja errors (e.g. roles out of order) are the request's fault
            raise _bad(f"messages could not be rendered with the chat template: {exc}", "messages") from None
        check_ids(ids, "messages")
        use_completion_tokens = req.max_completion_tokens is not None
        limit_param = "max_completion_tokens" if use_completion_tokens else "max_tokens"
        limit = req.max_completion_tokens if use_completion_tokens else req.max_tokens
        if limit is not None and limit < 1:
            raise _bad(f"{limit_param} must be at least 1, got {limit}", limit_param)
        params = sampling_params(
            req, req.max_completion_tokens if use_completion_tokens else req.max_tokens,
            "max_completion_tokens" if use_completion_tokens else "max_tokens", [len(ids)], "messages",
            req.logprobs, req.top_logprobs or 0, *((tools.json_schema(), "tools") if tools is not None else ()))

        if tools is not None and tools.auto:
            # Some tokenizers mark <tool_call> as special: keep such tokens in the text the parser reads.
            params.skip_special_tokens = False

        def with_calls(content: str | None, calls: list[ToolCall], acc: _Accumulated
                       ) -> tuple[list[ToolCall], str | None, str | None]:
            assert tools is not None
            return calls, tools.finish_reason(_finish_reason_str(acc.finish_reason), calls), content

        def tool_calls_of(acc: _Accumulated) -> tuple[list[ToolCall], str | None, str | None]:
            """(calls, finish reason, content) of a finished output."""
            assert tools is not None
            return with_calls(*tools.read("".join(acc.text)), acc)
        rid = req.rid or random_id("chatcmpl")
        group = submit([ids], params, rid, req.stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def stream() -> AsyncIterator[str]:
            created = int(time.time())
            started: set[int] = set()
            hermes: dict[int, HermesStream] = {}
            constrained_calls: dict[int, ConstrainedCallStream] = {}

            def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
                return _sse(ChatCompletionChunk(id=rid, created=created, model=state.model_name, choices=choices,
                                                usage=usage))

            def render_tool_calls(index: int, out: TokenOut, acc: _Accumulated) -> Iterator[str]:
                """Tool mode: each call starts once its name is known and its arguments stream as they are
                written (as vLLM). A named function or "required" (constrained): with their tokens' logprobs, if
                asked. Auto (hermes): the text before the model starts a call streams as content, the calls
                follow, and the last delta has any text after them (and the logprobs, if asked)."""
                assert tools is not None
                if not tools.auto:
                    scan = constrained_calls.setdefault(index, ConstrainedCallStream(tools.named))
                    deltas = scan.feed(out.text)
                    content = finish = None
                    if out.finish_reason is not None:
                        calls, finish, content = tool_calls_of(acc)
                        if scan.calls:  # calls went out already; a cut-off list is not also sent as text
                            content = None
                    if deltas or content or finish or (params.logprobs and out.logprobs):
                        yield chunk([ChatCompletionStreamChoice(
                            index=index, finish_reason=finish, logprobs=chat_logprobs(out) if params.logprobs else None,
                            delta=DeltaMessage(content=content, tool_calls=deltas or None))])
                    return
                parser = hermes.setdefault(index, HermesStream())
                content = parser.feed(out.text)
                deltas = parser.call_deltas()
                if out.finish_reason is None:
                    if content or deltas:
                        yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(
                            content=content or None, tool_calls=deltas or None))])
                    return
                rest, found = parser.finish()
                calls, finish, rest = with_calls(rest, found, acc)
                content = (content or "") + (rest or "") or None
                streamed = parser.streamed_calls  # the calls that went out piece by piece; the rest go whole
                deltas += [DeltaToolCall(index=k, **c.model_dump()) for k, c in enumerate(calls) if k >= streamed]
                yield chunk([ChatCompletionStreamChoice(
                    index=index, finish_reason=finish, logprobs=chat_logprobs(acc) if params.logprobs else None,
                    delta=DeltaMessage(content=content, tool_calls=deltas or None))])

            def render(index: int, out: TokenOut, acc: _Accumulated) -> Iterator[str]:
                if index not in started:
                    started.add(index)
                    yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                                              content=""))])
                if tools is not None:
                    yield from render_tool_calls(index, out, acc)
                elif out.text or out.finish_reason is not None or out.logprobs:
                    yield chunk([ChatCompletionStreamChoice(
                        index=index, delta=DeltaMessage(content=out.text or None),
                        logprobs=chat_logprobs(out) if params.logprobs else None,
                        finish_reason=_finish_reason_str(out.finish_reason),
                        matched_stop=_matched(out.finish_reason))])

            return _stream_events(group, render, (lambda accs: chunk([], _usage([len(ids)], accs, params.n)))
                                  if include_usage else None)

        result = await run_or_stream(group, request, stream() if req.stream else None)
        if not isinstance(result, list):
            return result
        choices = []
        for i, acc in enumerate(result):
            message = ChatResponseMessage(content="".join(acc.text))
            finish = _finish_reason_str(acc.finish_reason)
            if tools is not None:
                calls, finish, message.content = tool_calls_of(acc)
                message.tool_calls = calls or None
            choices.append(ChatCompletionChoice(index=i, message=message, finish_reason=finish,
                                                logprobs=chat_logprobs(acc) if params.logprobs else None,
                                                matched_stop=_matched(acc.finish_reason)))
        return ChatCompletionResponse(id=rid, model=state.model_name, choices=choices,
                                      usage=_usage([len(ids)], result, params.n))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        check_model(req.model)
        if req.suffix:
            raise _bad("suffix is not supported (no fill-in-the-middle yet)", "suffix")
        if req.best_of is not None and req.best_of not in (1, req.n):
            raise _bad(f"best_of must be 1 or n (servelm returns every sample it draws), got {req.best_of}",
                       "best_of")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [manager.encode(prompt)]
            texts: list[str | None] = [prompt]
        elif prompt and isinstance(prompt[0], str):
            prompts = [manager.encode(p) for p in prompt]  # type: ignore[arg-type]
            texts = list(prompt)  # type: ignore[arg-type]
        elif prompt and isinstance(prompt[0], list):
            prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
            texts = [None] * len(prompts)
        else:
            prompts = [list(prompt)]  # type: ignore[arg-type]
            texts = [None]
        if not prompts:
            raise _bad("prompt must not be empty", "prompt")
        for ids in prompts:
            check_ids(ids, "prompt")
        if req.max_tokens is not None and req.max_tokens < 1 and not (req.max_tokens == 0 and req.echo):
            raise _bad(f"max_tokens must be at least 1 (0 only with echo: the prompt back, scored with logprobs), "
                       f"got {req.max_tokens}", "max_tokens")
        k = req.logprobs
        if k is not None and not 0 <= k <= 20:
            raise _bad(f"logprobs must be in [0, 20], got {k}", "logprobs")
        params = sampling_params(req, req.max_tokens, "max_tokens", [len(p) for p in prompts], "prompt",
                                 k is not None, k or 0)
        # Echoed prompt tokens get their own logprobs (as with OpenAI's and vLLM's completions).
        params.prompt_logprobs = bool(req.echo) and k is not None
        n = params.n

        def echo_text(index: int) -> str:
            if not req.echo:
                return ""
            p = index // n
            return texts[p] if texts[p] is not None else manager.decode(prompts[p])  # type: ignore[return-value]

        def logprobs_of(index: int, got: TokenOut | _Accumulated, offset: int, first: bool) -> CompletionLogprobs:
            ids, lps, tops = got.token_ids, list(got.logprobs), list(got.top_logprobs)
            if req.echo and first:
                p = prompts[index // n]
                ids = p + ids
                lps = list(got.prompt_logprobs or [None] * len(p)) + lps
                tops = list(got.prompt_top_logprobs or [None] * len(p)) + tops
            return completion_logprobs(ids, lps, tops, offset)

        rid = req.rid or random_id("cmpl")
        group = submit(prompts, params, rid, req.stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def stream() -> AsyncIterator[str]:
            created = int(time.time())
            sent_echo: set[int] = set()
            offsets = [0] * len(group.subs)

            def event(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
                return _sse(CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                                               usage=usage))

            def render(index: int, out: TokenOut, acc: _Accumulated) -> Iterator[str]:
                first = index not in sent_echo
                sent_echo.add(index)
                text = (echo_text(index) if first else "") + out.text
                if not text and out.finish_reason is None and not out.logprobs:
                    return
                lp = logprobs_of(index, out, offsets[index], first) if params.logprobs else None
                offsets[index] += len(text)
                yield event([CompletionChoice(index=index, text=text, logprobs=lp,
                                              finish_reason=_finish_reason_str(out.finish_reason),
                                              matched_stop=_matched(out.finish_reason))])

            return _stream_events(group, render, (lambda accs: event([], _usage([len(p) for p in prompts], accs, n)))
                                  if include_usage else None)

        result = await run_or_stream(group, request, stream() if req.stream else None)
        if not isinstance(result, list):
            return result
        choices = []
        for i, acc in enumerate(result):
            lp = logprobs_of(i, acc, 0, True) if params.logprobs else None
            choices.append(CompletionChoice(index=i, text=echo_text(i) + "".join(acc.text), logprobs=lp,
                                            finish_reason=_finish_reason_str(acc.finish_reason),
                                            matched_stop=_matched(acc.finish_reason)))
        return CompletionResponse(id=rid, model=state.model_name, choices=choices,
                                  usage=_usage([len(p) for p in prompts], result, n))

    # ---------------------------------------------------- native API
    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        if (req.text is None) == (req.input_ids is None):
            raise _bad("give exactly one of text or input_ids", "text")
        if req.text is not None:
            batch = isinstance(req.text, list)
            prompts = [manager.encode(t) for t in (req.text if batch else [req.text])]  # type: ignore[union-attr]
            param = "text"
        else:
            ids_in = req.input_ids or []
            batch = bool(ids_in) and isinstance(ids_in[0], list)
            prompts = [list(p) for p in ids_in] if batch else [list(ids_in)]  # type: ignore[arg-type]
            param = "input_ids"
        if not prompts:
            raise _bad(f"{param} must not be empty", param)
        for ids in prompts:
            check_ids(ids, param)
        params = _native_sampling_params(req.sampling_params)
        ctx = manager.context_length
        longest = max(len(p) for p in prompts)
        try:
            params.validate(manager.vocab_size)
        except SamplingParamsError as exc:
            name = "max_new_tokens" if exc.param == "max_tokens" else exc.param
            raise _bad(f"sampling_params.{name}: {exc}", f"sampling_params.{name}") from None
        if ctx and longest + params.max_new_tokens > ctx:
            raise _bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                       f"{longest + params.max_new_tokens} tokens ({longest} in the prompt, "
                       f"{params.max_new_tokens} to generate).", "sampling_params.max_new_tokens")
        rid = req.rid or uuid.uuid4().hex
        group = submit(prompts, params, rid, req.stream)

        def meta(index: int, acc: _Accumulated, with_prompt_logprobs: bool = True) -> dict[str, Any]:
            return {"id": group.subs[index].public_id, "finish_reason": acc.finish_reason,
                    "prompt_tokens": acc.prompt_tokens or len(prompts[index // params.n]),
                    "completion_tokens": acc.completion_tokens or len(acc.token_ids),
                    "cached_tokens": acc.cached_tokens,
                    **({"output_token_logprobs": acc.logprobs, "output_top_logprobs": acc.top_logprobs}
                       if params.logprobs else {}),
                    **({"input_token_logprobs": acc.prompt_logprobs, "input_top_logprobs": acc.prompt_top_logprobs}
                       if params.prompt_logprobs and with_prompt_logprobs else {})}

        def item(index: int, acc: _Accumulated, with_prompt_logprobs: bool = True) -> dict[str, Any]:
            return {"text": "".join(acc.text), "output_ids": acc.token_ids, "index": index,
                    "meta_info": meta(index, acc, with_prompt_logprobs)}

        def stream() -> AsyncIterator[str]:
            # Cumulative text per chunk, as SGLang's /generate streams it.
            # The prompt's logprobs go once, in the event of the output that carried them.
            return _stream_events(group, lambda index, out, acc: iter([
                _sse(item(index, acc, with_prompt_logprobs=out.prompt_logprobs is not None))]))

        result = await run_or_stream(group, request, stream() if req.stream else None)
        if not isinstance(result, list):
            return result
        items = [item(i, acc) for i, acc in enumerate(result)]
        return items if batch or len(items) > 1 else items[0]

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise _bad("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise _bad("messages must be a non-empty list of messages", "messages")
            try:
                ids = manager.chat_prompt_ids([{"role": m.role, "content": m.text()} for m in req.messages],
                                              req.add_generation_prompt, template_kwargs=req.chat_template_kwargs)
            except Exception as exc:
                raise _bad(f"messages could not be rendered with the chat template: {exc}", "messages") from None
        else:
            ids = manager.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": manager.context_length}

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        vocab = manager.vocab_size
        for pos, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise _bad(f"tokens: token id {t} at position {pos} is out of range [0, {vocab})", "tokens")
        return {"prompt": manager.decode(req.tokens)}

    # ------------------------------------------------- operations
    @app.get("/health")
    async def health() -> Response:
        if state.shutting_down:
            return error_response(503, "The server is shutting down", type="service_unavailable")
        if not state.ready:
            return error_response(503, "The server is starting", type="service_unavailable",
                                  headers={"Retry-After": "1"})
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        ids = manager.encode("Hello", add_special_tokens=True) or [0]
        try:
            group = manager.submit([ids], params, f"health-{uuid.uuid4().hex}", False)
            accs = await asyncio.wait_for(_collect(group, request), timeout=30)
        except (QueueFullError, asyncio.TimeoutError, _ClientGone) as exc:
            return error_response(503, f"generation health check failed: {type(exc).__name__}: {exc}",
                                  type="service_unavailable")
        if not accs[0].token_ids:
            return error_response(503, f"generation health check failed: {accs[0].finish_reason}",
                                  type="service_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {**manager.model_info, "model_path": args.model_path or manager.model_info.get("model_path"),
                "tokenizer_path": tokenizer_display_path(args), "served_model_name": state.model_name,
                "is_generation": True}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        info = await scheduler_call(manager.server_info())
        server_args = dataclasses.asdict(args)
        if server_args.get("api_key"):
            server_args["api_key"] = "***"
        return {**info, "num_in_flight": manager.num_in_flight, "server_args": server_args,
                "version": __version__}

    async def scheduler_call(coro: Any) -> Any:
        try:
            return await coro
        except SchedulerUnavailableError as exc:
            raise ApiError(503, str(exc), type="service_unavailable") from None

    @app.post("/flush_cache")
    async def flush_cache() -> Any:
        out = await scheduler_call(manager.flush_cache())
        if not out.success:
            raise _bad(f"Cache not flushed: {out.message or 'requests are running'}")
        return {"success": True, "message": "Cache flushed."}

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> dict[str, Any]:
        return {"success": manager.abort_request(req.rid)}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.ready and not state.shutting_down:
            with contextlib.suppress(SchedulerUnavailableError):
                state.metrics.update_scheduler_state(await manager.server_info(timeout=5))
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    mount_chat_page(app)
    return app


class _GuardMiddleware:
    """Answers 401 (API key) and 503 (starting/stopping) before a request reaches its endpoint."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not is_open_path(scope["path"]):
            error = _guard_error(self.state, scope)
            if error is not None:
                await error(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _guard_error(state: ServerState, scope: Any) -> Response | None:
    """The 401/503 a request must get before reaching its endpoint, else None."""
    api_key = state.server_args.api_key
    if api_key is not None:
        # Compared as raw bytes: a client sends a non-ASCII key as UTF-8, which no str decoding of the
        # header (latin-1, as HTTP has it) would turn back into the key.
        auth = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                auth = value
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), api_key.encode()):
            return error_response(401, "Invalid or missing API key (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key")
    if state.shutting_down:
        return error_response(503, "The server is shutting down", type="service_unavailable")
    if not state.ready:
        return error_response(503, "The server is starting; retry when /health answers 200",
                              type="service_unavailable", headers={"Retry-After": "1"})
    return None


_SAMPLING_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_SAMPLING_ADAPTER = pydantic.TypeAdapter(SamplingParams)


def _native_sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a native request's dict, with 400s naming the field for unknown keys or bad types."""
    data = dict(raw)
    for key in data:
        if key not in _SAMPLING_FIELDS:
            raise _bad(f"sampling_params: unknown sampling parameter '{key}'", f"sampling_params.{key}")
    if isinstance(data.get("stop"), str):
        data["stop"] = [data["stop"]]
    try:
        params = _SAMPLING_ADAPTER.validate_python(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first.get("loc") else "sampling_params"
        raise _bad(f"sampling_params.{name}: {first['msg']}", f"sampling_params.{name}") from None
    for name in _SAMPLING_FIELDS:
        value = getattr(params, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise _bad(f"sampling_params.{name}: must be a finite number, got {value}", f"sampling_params.{name}")
    return params


# ------------------------------------------------------ startup/shutdown
def _wait_ready(state: ServerState) -> dict[str, Any]:
    """Block until the scheduler reports on its pipe (or dies, or we stop)."""
    reader, proc = state.ready_reader, state.proc
    assert reader is not None and proc is not None
    while not state.stop_event.is_set():
        if reader.poll(0.2):
            try:
                return reader.recv()
            except EOFError:
                break
        if not proc.is_alive():
            break
    code = proc.exitcode
    return {"status": "error", "message": f"the scheduler process exited (code {code}) before it was ready"}


async def _startup(state: ServerState) -> None:
    """Load the tokenizer while the scheduler loads the model; then mark ready and watch the scheduler."""
    args = state.server_args
    manager = state.manager
    try:
        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(load_server_tokenizer, args))
        # When the scheduler fails first, nobody awaits the tokenizer: mark its error as seen, or asyncio
        # prints it with a traceback ("exception was never retrieved") when the task is collected.
        tokenizer_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        msg = await asyncio.to_thread(_wait_ready, state)
        if state.stop_event.is_set():
            return
        if msg.get("status") != "ready":
            state.fail(f"The scheduler failed to start: {msg.get('message')}")
            return
        try:
            tokenizer = await tokenizer_task
        except Exception as exc:
            state.fail(f"Could not load the tokenizer: {type(exc).__name__}: {exc}")
            return
        manager.set_tokenizer(tokenizer)
        manager.model_info = dict(msg.get("model_info") or {})
        state.ready = True
        info = manager.model_info
        logger.info("servelm ready in %.1f s: model %s (%s), dtype %s, KV capacity %s tokens, context %s, "
                    "serving at http://%s:%d", time.monotonic() - state.started_at, state.model_name,
                    info.get("architecture", "?"),
                    info.get("dtype", "?"), info.get("kv_capacity_tokens", "?"),
                    info.get("max_context_length", "?"), args.host, args.port)
        while True:
            await asyncio.sleep(0.5)
            proc = state.proc
            if proc is not None and not proc.is_alive() and not state.shutting_down:
                rank = " (TP rank 0)" if args.tp_size > 1 else ""
                state.fail(f"The scheduler process{rank} died unexpectedly (exit code {proc.exitcode}); stopping")
                return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # never leave the server half-started
        logger.exception("startup failed")
        state.fail(f"Startup failed: {type(exc).__name__}: {exc}")


def _stop_scheduler(proc: Any) -> None:
    if proc is None or not proc.is_alive():
        return
    logger.info("Stopping the scheduler process")
    proc.terminate()
    proc.join(_SCHEDULER_STOP_TIMEOUT_S)
    if proc.is_alive():
        logger.warning("The scheduler process did not stop within %.0fs; killing it", _SCHEDULER_STOP_TIMEOUT_S)
        proc.kill()
        proc.join(_SCHEDULER_STOP_TIMEOUT_S)
    logger.info("Scheduler process stopped (exit code %s)", proc.exitcode)
    # NOTE: starting a 'spawn' process also started multiprocessing's resource tracker, a child
    # that ignores SIGTERM (so a process reaper would wait for it, then SIGKILL it). Stop it
    # now; it restarts by itself if anything needs it again. `_stop` is private, hence getattr.
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    with contextlib.suppress(Exception):
        getattr(tracker, "_stop", lambda: None)()


class _UvicornServer(uvicorn.Server):
    """uvicorn without re-raising the stop signal after a graceful shutdown, so that
    `launch_server` returns normally on Ctrl-C/SIGTERM; new requests get 503 meanwhile."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.state.shutting_down = True
        if self.state.stop_signal is None:
            self.state.stop_signal = sig
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        # Drain before uvicorn's own shutdown, which would cancel the running handlers mid-request
        # (plain-text 500s, streams cut without [DONE], CancelledError tracebacks).
        if not self.force_exit:
            await _drain(self.state)
        await super().shutdown(sockets)


async def _drain(state: ServerState) -> None:
    """Stop gracefully: new requests already get 503 (`shutting_down`, while the port stays open); running
    ones get up to --shutdown-timeout seconds (none on Ctrl-C, which a person wants at once) to finish;
    then each still open is ended with a 503 error body, or an SSE error event and [DONE]."""
    manager = state.manager
    grace = 0.0 if state.stop_signal == signal.SIGINT else state.server_args.shutdown_timeout
    deadline = time.monotonic() + grace
    while manager.num_in_flight and time.monotonic() < deadline and state.proc is not None and state.proc.is_alive():
        await asyncio.sleep(0.05)
    if manager.num_in_flight:
        logger.warning("Shutting down: ending %d running request(s) with an error%s", manager.num_in_flight,
                       f" after the {grace:g}s grace period (--shutdown-timeout)" if grace else "")
        manager.fail_all("The server is shutting down")
    # uvicorn's shutdown then waits (timeout_graceful_shutdown) for the handlers to send those errors.


def _listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to serve on; ServerError (one line) when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServerError(f"Port {port} on {host} is already in use (another server?): stop it or pass "
                              f"another --port") from None
        raise ServerError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _configure_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("servelm").setLevel(level.upper())


def launch_server(server_args: ServerArgs) -> None:
    """Start the scheduler process and serve HTTP until Ctrl-C/SIGTERM; blocks for the server's lifetime.

    Raises ServerError when the scheduler fails to start or dies, and SystemExit
    when uvicorn cannot bind the port. The scheduler process is stopped on
    every way out.
    """
    _configure_logging(server_args.log_level)
    if server_args.node_rank > 0:
        # Other nodes of a multi-node TP group only run their ranks; node 0 serves HTTP.
        from servelm.managers.tp_worker import run_node_workers

        code = run_node_workers(server_args)
        if code:
            raise ServerError(f"a TP rank on node {server_args.node_rank} exited with code {code}")
        return
    # The port first, before the model loads: a port in use is one line at once, not after the load.
    sock = _listen_socket(server_args.host, server_args.port)
    tmpdir = tempfile.mkdtemp(prefix="servelm-")
    to_scheduler = f"ipc://{os.path.join(tmpdir, 'to_scheduler')}"
    from_scheduler = f"ipc://{os.path.join(tmpdir, 'from_scheduler')}"
    model_name = served_model_name(server_args)
    metrics = ServerMetrics(model_name)
    manager = TokenizerManager(server_args, to_scheduler, from_scheduler, metrics)
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    # Not a daemon: under TP the scheduler process starts the other ranks. It still dies with
    # this process (die_with_parent) and is stopped on every way out below.
    proc = ctx.Process(target=run_scheduler_process, name="servelm-scheduler", daemon=False,
                       args=(server_args, to_scheduler, from_scheduler, writer, os.getpid()))
    state = ServerState(server_args=server_args, model_name=model_name, manager=manager, metrics=metrics,
                        proc=proc, ready_reader=reader)
    try:
        logger.info("Loading model %s in the scheduler process", server_args.model_path or "(default model)")
        proc.start()
        writer.close()
        app = build_app(state)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.uvicorn_log_level or server_args.log_level,
                                access_log=not server_args.disable_uvicorn_access_log, timeout_graceful_shutdown=3,
                                timeout_keep_alive=5)
        server = _UvicornServer(config, state)
        state.uvicorn_server = server
        # uvicorn logs no "Uvicorn running on ..." for a socket it is given: nothing may be sent yet, and
        # "servelm ready" is the line that says when.
        logger.info("HTTP port open at http://%s:%d; loading the model (requests get 503 until it is ready)",
                    server_args.host, server_args.port)
        server.run(sockets=[sock])
    finally:
        state.shutting_down = True
        state.stop_event.set()
        _stop_scheduler(proc)
        with contextlib.suppress(Exception):
            manager.close()
        reader.close()
        sock.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if state.fatal_error:
        raise ServerError(state.fatal_error)
