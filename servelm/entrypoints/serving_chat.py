"""POST /v1/chat/completions: the chat template, tool calls (constrained or read from the model's own
format), structured output, logprobs; streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from servelm.entrypoints.http_common import bad
from servelm.entrypoints.openai_protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from servelm.entrypoints.serving_base import OpenAIServing
from servelm.entrypoints.streaming import Accumulated, finish_reason_str, matched, sse, stream_events, usage
from servelm.entrypoints.tool_calls import (
    ConstrainedCallStream,
    HermesStream,
    ToolPlan,
    plan_tool_calls,
    template_messages,
)
from servelm.managers.io_struct import TokenOut
from servelm.managers.tokenizer_manager import RequestGroup
from servelm.sampling_params import SamplingParams


def check_text_only(req: ChatCompletionRequest) -> None:
    """A 400 for what a text-only model cannot take: image/audio/file content parts, audio output."""
    if req.audio is not None or any(m != "text" for m in req.modalities or []):
        raise bad("This model generates text only: modalities other than 'text' and audio output are not "
                  "supported", "audio" if req.audio is not None else "modalities")
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text":
                    raise bad(f"messages.{i}.content.{j}: this model takes text only; content of type "
                              f"'{part.type}' (images, audio, files) is not supported", "messages")


def calls_of(tools: ToolPlan, acc: Accumulated, content: str | None = None,
             found: list[ToolCall] | None = None) -> tuple[list[ToolCall], str | None, str | None]:
    """(calls, finish reason, content) of a finished output in tool mode: read from its text, or the calls
    `found` (and the `content` left) by a streaming parser."""
    if found is None:
        content, found = tools.read(acc.full_text)
    return found, tools.finish_reason(finish_reason_str(acc.finish_reason), found), content


class ServingChat(OpenAIServing):
    """The chat endpoint."""

    async def create(self, req: ChatCompletionRequest, request: Request) -> Any:
        """POST /v1/chat/completions."""
        ids, params, tools = self.prepare(req)
        rid = req.rid or random_id("chatcmpl")
        group = self.submit([ids], params, rid, req.stream)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = ChatStream(self, rid, len(ids), params, tools).events(group, include_usage)
            return await self.run_or_stream(group, request, events)
        result = await self.run_or_stream(group, request, None)
        if not isinstance(result, list):
            return result
        choices = []
        for i, acc in enumerate(result):
            message = ChatResponseMessage(content=acc.full_text)
            finish = finish_reason_str(acc.finish_reason)
            if tools is not None:
                calls, finish, message.content = calls_of(tools, acc)
                message.tool_calls = calls or None
            choices.append(ChatCompletionChoice(index=i, message=message, finish_reason=finish,
                                                logprobs=self.chat_logprobs(acc) if params.logprobs else None,
                                                matched_stop=matched(acc.finish_reason)))
        return ChatCompletionResponse(id=rid, model=self.state.model_name, choices=choices,
                                      usage=usage([len(ids)], result, params.n))

    def prepare(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, ToolPlan | None]:
        """Check the request; render its prompt with the chat template; its sampling params and tool plan."""
        self.check_model(req.model)
        if not req.messages:
            raise bad("messages must be a non-empty list of messages", "messages")
        if req.top_logprobs and not req.logprobs:
            raise bad("top_logprobs requires logprobs to be true", "top_logprobs")
        check_text_only(req)
        try:
            tools = plan_tool_calls(req.tools, req.tool_choice, self.state.server_args.tool_call_parser,
                                    parallel=req.parallel_tool_calls is not False)
        except ValueError as exc:
            raise bad(str(exc), "tool_choice") from None
        if tools is not None and req.response_format is not None and req.response_format.type != "text":
            raise bad("response_format cannot be combined with a tool_choice that calls a tool", "response_format")
        try:
            messages = template_messages(req.messages)
        except ValueError as exc:
            raise bad(str(exc), "messages") from None
        try:
            tool_dicts = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = self.manager.chat_prompt_ids(messages, req.add_generation_prompt, req.continue_final_message,
                                               tool_dicts, req.chat_template_kwargs)
        except Exception as exc:  # jinja errors (e.g. roles out of order) are the request's fault
            raise bad(f"messages could not be rendered with the chat template: {exc}", "messages") from None
        self.check_ids(ids, "messages")
        limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if limit is not None and limit < 1:
            raise bad(f"{limit_param} must be at least 1, got {limit}", limit_param)
        params = self.sampling_params(req, limit, limit_param, [len(ids)], "messages", req.logprobs,
                                      req.top_logprobs or 0,
                                      *((tools.json_schema(), "tools") if tools is not None else ()))
        if tools is not None and tools.auto:
            # Some tokenizers mark <tool_call> as special: keep such tokens in the text the parser reads.
            params.skip_special_tokens = False
        return ids, params, tools

    def chat_logprobs(self, out: TokenOut | Accumulated) -> ChatLogprobs:
        """OpenAI chat logprobs of the tokens of `out` that carry one."""
        content = []
        for k, tid in enumerate(out.token_ids[:len(out.logprobs)]):
            text = self.manager.token_text(tid)
            tops = [TopLogprob(token=(alt := self.manager.token_text(t)), logprob=lp, bytes=list(alt.encode()))
                    for t, lp in (out.top_logprobs[k] if k < len(out.top_logprobs) else [])]
            content.append(ChatTokenLogprob(token=text, logprob=out.logprobs[k], bytes=list(text.encode()),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)


class ChatStream:
    """The SSE events of one streamed chat request: a role delta first, then content (or tool calls) with
    the finish reason, usage if asked, [DONE]."""

    def __init__(self, serving: ServingChat, rid: str, prompt_len: int, params: SamplingParams,
                 tools: ToolPlan | None) -> None:
        self.serving = serving
        self.rid = rid
        self.prompt_len = prompt_len
        self.params = params
        self.tools = tools
        self.created = int(time.time())
        self.started: set[int] = set()
        self.hermes: dict[int, HermesStream] = {}
        self.constrained: dict[int, ConstrainedCallStream] = {}

    def events(self, group: RequestGroup, include_usage: bool) -> AsyncIterator[str]:
        return stream_events(group, self.render, (lambda accs: self.chunk(
            [], usage([self.prompt_len], accs, self.params.n))) if include_usage else None)

    def chunk(self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.rid, created=self.created, model=self.serving.state.model_name,
                                       choices=choices, usage=usage))

    def logprobs(self, out: TokenOut | Accumulated) -> ChatLogprobs | None:
        return self.serving.chat_logprobs(out) if self.params.logprobs else None

    def render(self, index: int, out: TokenOut, acc: Accumulated) -> Iterator[str]:
        if index not in self.started:
            self.started.add(index)
            yield self.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                                         content=""))])
        if self.tools is not None and self.tools.auto:
            yield from self.render_hermes(index, out, acc)
        elif self.tools is not None:
            yield from self.render_constrained(index, out, acc)
        elif out.text or out.finish_reason is not None or out.logprobs:
            yield self.chunk([ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(content=out.text or None), logprobs=self.logprobs(out),
                finish_reason=finish_reason_str(out.finish_reason), matched_stop=matched(out.finish_reason))])

    def render_constrained(self, index: int, out: TokenOut, acc: Accumulated) -> Iterator[str]:
        """A named function or "required": each call starts once its name is known, then its arguments
        stream as they are written (as vLLM), with their tokens' logprobs if asked."""
        assert self.tools is not None
        scan = self.constrained.setdefault(index, ConstrainedCallStream(self.tools.named))
        deltas = scan.feed(out.text)
        content = finish = None
        if out.finish_reason is not None:
            _, finish, content = calls_of(self.tools, acc)
            if scan.calls:  # calls went out already; a cut-off list is not also sent as text
                content = None
        if deltas or content or finish or (self.params.logprobs and out.logprobs):
            yield self.chunk([ChatCompletionStreamChoice(
                index=index, finish_reason=finish, logprobs=self.logprobs(out),
                delta=DeltaMessage(content=content, tool_calls=deltas or None))])

    def render_hermes(self, index: int, out: TokenOut, acc: Accumulated) -> Iterator[str]:
        """Auto (hermes): the text before the model starts a call streams as content, the calls follow as
        they are written, and the last delta has any text after them (and the logprobs, if asked)."""
        assert self.tools is not None
        parser = self.hermes.setdefault(index, HermesStream())
        content = parser.feed(out.text)
        deltas = parser.call_deltas()
        if out.finish_reason is None:
            if content or deltas:
                yield self.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(
                    content=content or None, tool_calls=deltas or None))])
            return
        rest, found = parser.finish()
        calls, finish, rest = calls_of(self.tools, acc, rest, found)
        text = (content or "") + (rest or "") or None
        streamed = parser.streamed_calls  # the calls that went out piece by piece; the rest go whole
        deltas += [DeltaToolCall(index=k, **c.model_dump()) for k, c in enumerate(calls) if k >= streamed]
        yield self.chunk([ChatCompletionStreamChoice(index=index, finish_reason=finish, logprobs=self.logprobs(acc),
                                                     delta=DeltaMessage(content=text, tool_calls=deltas or None))])
