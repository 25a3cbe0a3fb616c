"""OpenAI's Responses API: POST /v1/responses (create, streamed or not, or in the background),
GET /v1/responses/{id}, POST /v1/responses/{id}/cancel, DELETE /v1/responses/{id}.

Text in (a string or input messages, with `instructions` as the system message and the conversation of
`previous_response_id` before it), text out; `text.format` json_schema / json_object is enforced by the
same constrained decoding as chat's response_format. Stored responses (`store`, the default) live in a
bounded in-memory LRU store: the oldest are forgotten first, and nothing survives a restart. A response's
id is also its request id, so cancelling an in-flight one aborts it in the scheduler.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from servelm.entrypoints import tool_parsers
from servelm.entrypoints.http_common import ApiError, bad
from servelm.entrypoints.openai_protocol import ChatTool, FunctionDefinition, NamedToolChoice, ToolChoiceFunction
from servelm.entrypoints.reasoning import ReasoningStream
from servelm.entrypoints.responses_protocol import (
    FunctionCallInput,
    FunctionCallItem,
    FunctionCallOutputInput,
    NamedFunction,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from servelm.entrypoints.serving_base import OpenAIServing
from servelm.entrypoints.streaming import Accumulated, stream_events
from servelm.entrypoints.tool_calls import ToolPlan, plan_tool_calls
from servelm.managers.tokenizer_manager import RequestGroup
from servelm.sampling_params import SamplingParams, SamplingParamsError

STORE_SIZE = 1000  # stored responses kept (least recently used forgotten first)


@dataclass
class Stored:
    response: ResponseObject
    messages: list[dict[str, str]]  # the conversation without instructions: input, then the output once done
    task: asyncio.Task | None = field(default=None, repr=False)  # a background response's collector
    split: ReasoningStream | None = field(default=None, repr=False)  # with a reasoning parser
    tools: ToolPlan | None = field(default=None, repr=False)  # how the output becomes function calls


class ResponseStore:
    """Responses by id: at most `size` finished ones, least recently used evicted first (a response still
    queued or in progress is never evicted: it stays retrievable and cancellable until it ends)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()

    def put(self, entry: Stored) -> None:
        self._items[entry.response.id] = entry
        self._items.move_to_end(entry.response.id)
        excess = len(self._items) - self.size
        if excess > 0:
            finished = [rid for rid, item in self._items.items() if item.response.finished][:excess]
            for rid in finished:
                del self._items[rid]

    def get(self, response_id: str) -> Stored:
        entry = self._items.get(response_id)
        if entry is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        self._items.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> Stored:
        entry = self.get(response_id)
        del self._items[response_id]
        return entry

    def __len__(self) -> int:
        return len(self._items)


def text_format_schema(req: ResponsesRequest) -> str | None:
    """The JSON schema (a string) that `text.format` asks the output to follow, if any."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return '{"type": "object"}'
    if fmt.schema_ is None:
        raise bad("text.format: type json_schema needs a schema", "text.format.schema")
    return json.dumps(fmt.schema_)


def finish(entry: Stored, acc: Accumulated, tokenizer: Any = None, prefix_cache: bool = True,
           keep_message: bool = False) -> None:
    """Fill the entry's response from a finished request's outputs; with a reasoning parser (`entry.split`: fed
    the whole output already by a stream, or here) its thinking is a reasoning item before the message."""
    resp, reason, split = entry.response, acc.finish_reason, entry.split
    text = acc.full_text
    reasoning_tokens = 0
    if split is not None:
        if not split.finished:
            split.feed(text)
            split.finish()
        text = split.answer_text
        reasoning_tokens = split.reasoning_tokens(acc.token_ids, tokenizer)
    if resp.status != "cancelled":
        if reason is not None and reason.is_failure:
            resp.status, resp.error = "failed", {"code": "server_error", "message": str(reason.message)}
        elif reason is not None and reason.type == "abort":
            resp.status = "cancelled"
        elif reason is not None and reason.type == "length":
            resp.status, resp.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            resp.status = "completed"
    status = "completed" if resp.status == "completed" else "incomplete"
    ids = {type(item): item.id for item in resp.output}
    thinking = [ReasoningItem(id=ids.get(ReasoningItem, ReasoningItem().id), status=status,
                              content=[ReasoningText(text=split.reasoning_text)])] \
        if split is not None and split.reasoning_text else []
    calls: list[FunctionCallItem] = []
    if entry.tools is not None:
        content, found = entry.tools.read(text)
        text = content or ""
        calls = [FunctionCallItem(call_id=c.id, name=c.function.name, arguments=c.function.arguments) for c in found]
    message = [OutputMessage(id=ids.get(OutputMessage, OutputMessage().id), status=status,
                             content=[OutputText(text=text)])] if text or not calls or keep_message else []
    resp.output = [*thinking, *message, *calls]
    writes = acc.prompt_tokens - acc.cached_tokens if prefix_cache else 0
    resp.usage = ResponseUsage(input_tokens=acc.prompt_tokens,
                               input_tokens_details={"cached_tokens": acc.cached_tokens, "cache_write_tokens": writes},
                               output_tokens=acc.completion_tokens,
                               output_tokens_details={"reasoning_tokens": reasoning_tokens},
                               total_tokens=acc.prompt_tokens + acc.completion_tokens,
                               prompt_tokens=acc.prompt_tokens, completion_tokens=acc.completion_tokens)
    reply: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        reply["tool_calls"] = [_template_call(c.call_id, c.name, c.arguments) for c in calls]
    entry.messages.append(reply)


def _template_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A call as chat templates take it (its arguments an object: templates write them with `| tojson`)."""
    try:
        args: Any = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


class ServingResponses(OpenAIServing):
    """The /v1/responses endpoints over one in-memory store."""

    def __init__(self, state: Any, store_size: int = STORE_SIZE) -> None:
        super().__init__(state)
        self.prefix_cache = not state.server_args.disable_radix_cache
        self.store = ResponseStore(store_size)
        self._background: set[asyncio.Task] = set()

    # ---------------------------------------------------------------- create
    def conversation(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The messages before the output: the previous response's conversation, then this input (function
        calls sent back become the assistant's tool calls, their outputs `tool` messages)."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            if not req.previous_response_id.startswith("resp"):
                raise bad(f"Invalid 'previous_response_id': '{req.previous_response_id}'. Expected an ID that begins "
                          "with 'resp'.", "previous_response_id")
            try:
                previous = self.store.get(req.previous_response_id)
            except ApiError as exc:
                raise ApiError(404, exc.message, param="previous_response_id", code="response_not_found") from None
            if not previous.response.finished:
                raise bad(f"Response '{req.previous_response_id}' is still {previous.response.status}: continue "
                          "from it once it has finished.", "previous_response_id")
            history = list(previous.messages)
        if isinstance(req.input, str):
            return [*history, {"role": "user", "content": req.input}]
        if not req.input:
            raise bad("input must be a non-empty string or list of messages", "input")
        roles = {"developer": "system"}
        out = list(history)
        for item in req.input:
            if isinstance(item, FunctionCallInput):
                call = _template_call(item.call_id, item.name, item.arguments)
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                    out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputInput):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                out.append({"role": roles.get(item.role, item.role), "content": item.text()})
        return out

    def tool_plan(self, req: ResponsesRequest) -> ToolPlan | None:
        """The request's tools as the chat endpoint plans them (constrained for required / a named function,
        the --tool-call-parser for auto)."""
        tools = [ChatTool(function=FunctionDefinition(name=t.name, description=t.description,
                                                     parameters=t.parameters, strict=t.strict))
                 for t in req.tools or []]
        choice: Any = req.tool_choice
        if isinstance(choice, NamedFunction):
            choice = NamedToolChoice(function=ToolChoiceFunction(name=choice.name))
        parser_name = self.tool_parser_name() if tools else None
        try:
            return plan_tool_calls(tools or None, choice, tool_parsers.make_parser(parser_name, tools)
                                   if parser_name else None, parallel=req.parallel_tool_calls is not False)
        except ValueError as exc:
            raise bad(str(exc), "tool_choice") from None

    def sampling(self, req: ResponsesRequest, prompt_len: int, tools: ToolPlan | None = None) -> SamplingParams:
        self.check_context(prompt_len, None, "input", "max_output_tokens")
        if req.max_output_tokens is not None and req.max_output_tokens < 1:
            raise bad(f"max_output_tokens must be at least 1, got {req.max_output_tokens}", "max_output_tokens")
        schema = text_format_schema(req)
        if tools is not None and not tools.auto:
            if schema is not None:
                raise bad("text.format cannot be combined with a tool_choice that calls a tool", "text.format")
            schema = tools.json_schema()
        kw: dict[str, Any] = {"max_new_tokens": req.max_output_tokens or self.manager.context_length - prompt_len,
                              "json_schema": schema}
        if tools is not None and tools.auto:
            kw["skip_special_tokens"] = False  # a parser's markers may be special tokens
        for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty", "stop"):
            if getattr(req, name) is not None:
                kw[name] = getattr(req, name)
        params = SamplingParams(**kw)
        try:
            params.validate(self.manager.vocab_size)
        except SamplingParamsError as exc:
            param = {"max_tokens": "max_output_tokens", "json_schema": "text.format.schema"}.get(exc.param, exc.param)
            raise bad(str(exc).replace(exc.param, param, 1), param) from None
        self.check_context(prompt_len, params.max_new_tokens, "input", "max_output_tokens")
        return params

    def check_request(self, req: ResponsesRequest) -> None:
        self.check_model(req.model)
        if req.background and not req.store:
            raise bad("a background response must be stored: background requires store to be true", "background")
        if req.background and req.stream:
            raise bad("background responses cannot be streamed here: poll GET /v1/responses/{id}", "stream")

    async def create(self, req: ResponsesRequest, request: Request) -> Any:
        self.check_request(req)
        messages = self.conversation(req)
        plan = self.tool_plan(req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        tool_dicts = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
                      for t in req.tools] if req.tools else None
        def render(turns: list[dict[str, Any]]) -> list[int]:
            try:
                return self.manager.chat_prompt_ids(system + turns, tools=tool_dicts)
            except Exception as exc:
                raise bad(f"input could not be rendered with the chat template: {exc}", "input") from None

        ids = render(messages)
        if req.truncation == "auto":  # drop the oldest turns (a tool result with its call) until the input fits
            room = self.manager.context_length - max(1, req.max_output_tokens or 1)
            while len(ids) > room and len(messages) > 1:
                messages = messages[1:]
                while len(messages) > 1 and messages[0]["role"] == "tool":
                    messages = messages[1:]
                ids = render(messages)
        params = self.sampling(req, len(ids), plan)
        self.prepare_reasoning(params, ids)
        resp = ResponseObject(model=self.state.model_name, status="queued" if req.background else "in_progress",
                              instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                              temperature=req.temperature, top_p=req.top_p, store=req.store,
                              background=req.background, previous_response_id=req.previous_response_id,
                              metadata=req.metadata, user=req.user,
                              parallel_tool_calls=req.parallel_tool_calls is not False if req.tools else False,
                              tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
                              truncation=req.truncation or "disabled",
                              tool_choice=(req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
                                           else req.tool_choice or ("auto" if req.tools else "none")),
                              text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
                              if req.text is not None else {"format": {"type": "text"}})
        entry = Stored(resp, messages, split=self.reasoning_stream(ids, plan), tools=plan)
        group = self.submit([ids], params, resp.id, req.stream)
        if req.store:
            self.store.put(entry)
        if req.background:
            entry.task = asyncio.ensure_future(self._collect_in_background(group, entry))
            self._background.add(entry.task)  # a strong reference until it ends (the store may drop the entry)
            entry.task.add_done_callback(self._background.discard)
            return resp
        if req.stream:
            return await self.run_or_stream(group, request, self._stream(group, entry))
        try:
            result = await self.run_or_stream(group, request, None)
        except ApiError as exc:
            resp.status, resp.error = "failed", {"code": "server_error", "message": exc.message}
            raise
        if not isinstance(result, list):  # the client hung up: its request was aborted
            resp.status = "cancelled"
            return result
        finish(entry, result[0], self.manager.tokenizer, self.prefix_cache)
        return resp

    async def _collect_in_background(self, group: RequestGroup, entry: Stored) -> None:
        acc = Accumulated()
        entry.response.status = "in_progress" if entry.response.status == "queued" else entry.response.status
        try:
            async for _, out in group.outputs():
                acc.add(out)
        except Exception as exc:  # e.g. the scheduler went away: the response fails, it does not stay in progress
            entry.response.status, entry.response.error = "failed", {"code": "server_error", "message": str(exc)}
            return
        finish(entry, acc, self.manager.tokenizer, self.prefix_cache)

    def _stream(self, group: RequestGroup, entry: Stored) -> AsyncIterator[str]:
        """The Responses streaming events: created, in_progress; with a reasoning parser, the reasoning item
        (added, reasoning text deltas, done) while the model thinks; the message and its text part added, text
        deltas (with tools: the text before any call, as the --tool-call-parser lets it out), then text/part/item
        done; each function call (added, its arguments, done) once the output is complete; the final
        response.completed (or .incomplete / .failed)."""
        resp, seq, split, tools = entry.response, itertools.count(), entry.split, entry.tools
        msg, thought = OutputMessage(), ReasoningItem()
        resp.output = []
        shown = {"reasoning": False, "reasoning done": False, "message": False}  # what the events added / ended
        calls_text = None
        if tools is not None and tools.auto:  # the text before a call streams; the calls come at the end
            calls_text = tools.parser.stream()

        def event(kind: str, **fields: Any) -> str:
            data = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        def where(item: Any) -> dict[str, Any]:
            return {"item_id": item.id, "output_index": resp.output.index(item), "content_index": 0}

        def close_reasoning() -> Iterator[str]:
            """The reasoning item's end (it is output 0; after `finish` the response holds its final copy)."""
            if shown["reasoning"] and not shown["reasoning done"]:
                shown["reasoning done"] = True
                final = resp.output[0] if resp.finished and isinstance(resp.output[0], ReasoningItem) else None
                item = final or thought.model_copy(update={"status": "completed",
                                                           "content": [ReasoningText(text=split.reasoning_text)]})
                yield event("response.reasoning_text.done", text=split.reasoning_text, item_id=thought.id,
                            output_index=0, content_index=0)
                yield event("response.output_item.done", output_index=0, item=item.model_dump())

        def open_message() -> Iterator[str]:
            if not shown["message"]:
                yield from close_reasoning()
                shown["message"] = True
                resp.output.append(msg)
                yield event("response.output_item.added", output_index=resp.output.index(msg), item=msg.model_dump())
                yield event("response.content_part.added", part=OutputText(text="").model_dump(), **where(msg))

        def render(index: int, out: Any, acc: Accumulated) -> Iterator[str]:
            thinking, answer = "", out.text
            if split is not None:
                thinking, answer = split.feed(out.text)
                if out.finish_reason is not None:
                    more = split.finish()
                    thinking, answer = thinking + more[0], answer + more[1]
                if thinking and not shown["reasoning"]:
                    shown["reasoning"] = True
                    resp.output.append(thought)
                    yield event("response.output_item.added", output_index=0, item=thought.model_dump())
                if thinking and not shown["reasoning done"]:
                    yield event("response.reasoning_text.delta", delta=thinking, **where(thought))
            if tools is not None:  # only the text the parser lets out (none for a constrained call)
                answer = calls_text.feed(answer) if calls_text is not None else ""
            if answer:
                yield from open_message()
                yield event("response.output_text.delta", delta=answer, logprobs=[], **where(msg))
            if out.finish_reason is None:
                return
            finish(entry, acc, self.manager.tokenizer, self.prefix_cache, keep_message=shown["message"])
            yield from close_reasoning()
            for item in resp.output:
                if isinstance(item, OutputMessage):
                    if not shown["message"]:
                        shown["message"] = True
                        yield event("response.output_item.added", output_index=resp.output.index(item),
                                    item=item.model_copy(update={"status": "in_progress", "content": []}).model_dump())
                        yield event("response.content_part.added", part=OutputText(text="").model_dump(),
                                    **where(item))
                        if item.content[0].text:
                            yield event("response.output_text.delta", delta=item.content[0].text, logprobs=[],
                                        **where(item))
                    yield event("response.output_text.done", text=item.content[0].text, logprobs=[], **where(item))
                    yield event("response.content_part.done", part=item.content[0].model_dump(), **where(item))
                    yield event("response.output_item.done", output_index=resp.output.index(item),
                                item=item.model_dump())
                elif isinstance(item, FunctionCallItem):
                    at = resp.output.index(item)
                    yield event("response.output_item.added", output_index=at,
                                item=item.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump())
                    yield event("response.function_call_arguments.delta", item_id=item.id, output_index=at,
                                delta=item.arguments)
                    yield event("response.function_call_arguments.done", item_id=item.id, output_index=at,
                                arguments=item.arguments, name=item.name)
                    yield event("response.output_item.done", output_index=at, item=item.model_dump())
            final = {"completed": "response.completed", "failed": "response.failed"}.get(resp.status,
                                                                                       "response.incomplete")
            yield event(final, response=resp.model_dump())

        async def events() -> AsyncIterator[str]:
            yield event("response.created", response=resp.model_dump())
            yield event("response.in_progress", response=resp.model_dump())
            if split is None and tools is None:
                for e in open_message():
                    yield e
            try:
                async for chunk in stream_events(group, render):
                    yield chunk
            except GeneratorExit:  # the client hung up: its request was aborted
                if not resp.finished:
                    resp.status = "cancelled"
                raise
            finally:
                if not resp.finished:  # an error event was sent instead of the end
                    resp.status = "failed"

        return events()

    # ---------------------------------------------------------- the others
    async def retrieve(self, response_id: str) -> ResponseObject:
        return self.store.get(response_id).response

    async def cancel(self, response_id: str) -> ResponseObject:
        """Cancel a response still queued or in progress (a finished one is a 400)."""
        entry = self.store.get(response_id)
        resp = entry.response
        if resp.finished:
            raise bad(f"Cannot cancel response '{response_id}': it is already {resp.status}.", "response_id")
        if self.manager.abort_request(response_id):  # else it just ended: its collector records how
            resp.status = "cancelled"
        return resp

    async def delete(self, response_id: str) -> dict[str, Any]:
        entry = self.store.pop(response_id)
        if not entry.response.finished:
            self.manager.abort_request(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
