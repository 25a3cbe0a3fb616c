"""Streaming and collecting a request's outputs, shared by every endpoint.

`stream_events` is the one SSE loop (each endpoint only renders its events for an output), `collect` waits
for a non-streamed request (aborting it when the client hangs up), `Accumulated` gathers what one
sub-request produced, and `error_of` says which outputs are errors (a request the scheduler refused or
lost) rather than results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pydantic
from fastapi import Request

from servelm.entrypoints.http_common import ApiError, bad
from servelm.entrypoints.openai_protocol import ErrorDetail, ErrorResponse, PromptTokensDetails, UsageInfo
from servelm.managers.io_struct import FinishReason, OutputAccumulator, TokenOut
from servelm.managers.tokenizer_manager import RequestGroup

DISCONNECT_POLL_S = 0.05  # a hung-up client frees its KV within this much
SSE_DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON."""
    data = obj.model_dump_json() if isinstance(obj, pydantic.BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


# One request's outputs gathered (shared with the offline Engine).
Accumulated = OutputAccumulator


class ClientGone(Exception):
    """The client of a non-streamed request hung up (its request was aborted)."""


def finish_reason_str(reason: FinishReason | None) -> str | None:
    """The OpenAI finish_reason string of a scheduler finish reason."""
    return None if reason is None else reason.type


def matched(reason: FinishReason | None) -> int | str | None:
    """The stop string or token id that ended the output (SGLang's matched_stop), if any."""
    return None if reason is None else reason.matched


def error_of(out: TokenOut | Accumulated) -> ApiError | None:
    """The error a request that the scheduler refused or lost should answer, else None (a partial result
    or a client's abort is an answer: its finish reason is "abort")."""
    reason = out.finish_reason
    if reason is None or not reason.is_failure:
        return None
    if reason.internal:
        return ApiError(503, str(reason.message), type="service_unavailable")
    return None if out.token_ids else bad(str(reason.message))


def stream_error_event(err: ApiError) -> str:
    """An SSE event with the OpenAI error shape (a stream cannot change its status once started)."""
    return sse(ErrorResponse(error=ErrorDetail(message=err.message, type=err.type, param=err.param, code=err.code)))


async def stream_events(group: RequestGroup, render: Callable[[int, TokenOut, Accumulated], Iterator[str]],
                        usage_event: Callable[[list[Accumulated]], str] | None = None) -> AsyncIterator[str]:
    """The SSE events of a streamed request group, one loop for every endpoint.

    Each output is added to its sub-request's accumulator and handed to `render` (the endpoint's events for
    it); a failed output becomes an error event instead. Then the usage event, if any, and [DONE].
    """
    accs = [Accumulated() for _ in group.subs]
    async for index, out in group.outputs():
        accs[index].add(out)
        err = error_of(out)
        if err is not None:
            yield stream_error_event(err)
            continue
        for event in render(index, out, accs[index]):
            yield event
    if usage_event is not None:
        yield usage_event(accs)
    yield SSE_DONE


async def collect(group: RequestGroup, request: Request) -> list[Accumulated]:
    """Wait for every output of the group; abort it (and raise ClientGone) if the client hangs up."""
    accs = [Accumulated() for _ in group.subs]

    async def consume() -> None:
        async for index, out in group.outputs():
            accs[index].add(out)

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return accs
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def usage(prompt_lens: list[int], accs: list[Accumulated], n: int) -> UsageInfo:
    """Token counts of a request group; a prompt counts once however many samples it has (as OpenAI does)."""
    prompt_tokens = sum(prompt_lens)
    completion = sum(a.completion_tokens or len(a.token_ids) for a in accs)
    cached = sum(max((a.cached_tokens for a in accs[p * n:(p + 1) * n]), default=0)
                 for p in range(len(prompt_lens)))
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
