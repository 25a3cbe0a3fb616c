"""POST /v1/chat/completions: the chat template, tool calls (constrained or read from the model's own
format), structured output, logprobs; streamed or not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from servelm.entrypoints import tool_parsers
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
    CompletionTokensDetails,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from servelm.entrypoints.reasoning import ReasoningStream
from servelm.entrypoints.serving_base import OpenAIServing
from servelm.entrypoints.streaming import Accumulated, finish_reason_str, matched, sse, stream_events, usage
from servelm.entrypoints.tool_calls import (
    ConstrainedCallStream,
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
             found: list[ToolCall] | None = None, text: str | None = None
             ) -> tuple[list[ToolCall], str | None, str | None]:
    """(calls, finish reason, content) of a finished output in tool mode: read from its text (`text`: the
    answer after any thinking), or the calls `found` (and the `content` left) by a streaming parser."""
    if found is None:
        content, found = tools.read(acc.full_text if text is None else text)
    return found, tools.finish_reason(finish_reason_str(acc.finish_reason), found), content


def with_reasoning(u: UsageInfo, counts: list[int] | None) -> UsageInfo:
    """`usage` with completion_tokens_details.reasoning_tokens when a reasoning parser split the outputs."""
    if counts is not None:
        u.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(counts))
    return u


class ServingChat(OpenAIServing):
    """The chat endpoint."""

    async def create(self, req: ChatCompletionRequest, request: Request) -> Any:
        """POST /v1/chat/completions."""
        if self.state.server_args.return_tokens_as_token_ids:
            req.return_tokens_as_token_ids = True
        ids, params, tools = self.prepare(req)
        rid = req.rid or random_id("chatcmpl")
        group = self.submit([ids], params, rid, req.stream)
        if req.stream:
            events = ChatStream(self, rid, ids, params, tools, req).events(group)
            return await self.run_or_stream(group, request, events)
        result = await self.run_or_stream(group, request, None)
        if not isinstance(result, list):
            return result
        as_ids = req.return_tokens_as_token_ids
        counts: list[int] | None = [] if self.reasoning_format() is not None else None
        choices = [self.choice(req, i, acc, params, tools, ids, counts) for i, acc in enumerate(result)]
        return ChatCompletionResponse(
            id=rid, model=self.state.model_name, choices=choices,
            usage=with_reasoning(usage([len(ids)], result, params.n), counts),
            prompt_token_ids=ids if req.return_token_ids else None,
            prompt_logprobs=(None if req.prompt_logprobs is None else
                             self.vllm_prompt_logprobs(ids, result[0], req.prompt_logprobs, as_ids)))

    def choice(self, req: ChatCompletionRequest, index: int, acc: Accumulated, params: SamplingParams,
               tools: ToolPlan | None, prompt: list[int] | None = None,
               reasoning_counts: list[int] | None = None) -> ChatCompletionChoice:
        """One choice of a non-streamed reply: its message (thinking, echo, tool calls), logprobs, token ids;
        with a reasoning parser, its thinking tokens go to `reasoning_counts`."""
        text = acc.full_text
        message = ChatResponseMessage(content=text)
        split = self.reasoning_stream(prompt or [], tools)
        if split is not None:
            split.feed(text)
            split.finish()
            text = split.answer_text
            message.reasoning_content = message.reasoning = split.reasoning_text or None
            message.content = text or (None if message.reasoning else text)
            if reasoning_counts is not None:
                reasoning_counts.append(split.reasoning_tokens(acc.token_ids, self.manager.tokenizer))
        finish = finish_reason_str(acc.finish_reason)
        if tools is not None:
            calls, finish, message.content = calls_of(tools, acc, text=text)
            message.tool_calls = calls or None
        echo = echo_text(req)
        if echo:
            message.content = echo + (message.content or "")
        return ChatCompletionChoice(
            index=index, message=message, finish_reason=finish, matched_stop=matched(acc.finish_reason),
            logprobs=self.chat_logprobs(acc, req.return_tokens_as_token_ids) if params.logprobs else None,
            token_ids=acc.token_ids if req.return_token_ids else None)

    def prepare(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, ToolPlan | None]:
        """Check the request; render its prompt with the chat template; its sampling params and tool plan."""
        self.check_model(req.model)
        if not req.messages:
            raise bad("messages must be a non-empty list of messages", "messages")
        req.top_logprobs = self.logprobs_count(req.top_logprobs, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise bad("top_logprobs requires logprobs to be true", "top_logprobs")
        check_text_only(req)
        try:
            parser_name = self.tool_parser_name() if req.tools else None
            parser = tool_parsers.make_parser(parser_name, req.tools) if parser_name else None
            tools = plan_tool_calls(req.tools, req.tool_choice, parser,
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
        ids = self.truncate(ids, req.truncate_prompt_tokens, req.truncation_side)
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
        self.prepare_reasoning(params, ids)
        return ids, params, tools

    def chat_logprobs(self, out: TokenOut | Accumulated, as_ids: bool = False) -> ChatLogprobs:
        """OpenAI chat logprobs of the tokens of `out` that carry one (tokens as `token_id:N` with as_ids)."""
        content = []
        for k, tid in enumerate(out.token_ids[:len(out.logprobs)]):
            text = self.token_str(tid, as_ids)
            tops = [TopLogprob(token=(alt := self.token_str(t, as_ids)), logprob=lp, bytes=list(alt.encode()))
                    for t, lp in (out.top_logprobs[k] if k < len(out.top_logprobs) else [])]
            content.append(ChatTokenLogprob(token=text, logprob=out.logprobs[k], bytes=list(text.encode()),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)


def echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content, when that message has the reply's role (the assistant's,
    or with add_generation_prompt false the last message's own)."""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    return last.text() if req.echo and last.role == role else ""


class ChatStream:
    """The SSE events of one streamed chat request: a role delta first (and the echo), then content (or tool
    calls) with the finish reason, usage if asked (on every chunk with continuous_usage_stats), [DONE]."""

    def __init__(self, serving: ServingChat, rid: str, prompt: list[int], params: SamplingParams,
                 tools: ToolPlan | None, req: ChatCompletionRequest) -> None:
        self.serving = serving
        self.rid = rid
        self.prompt = prompt
        self.params = params
        self.tools = tools
        self.req = req
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options and options.continuous_usage_stats)
        self.usage_now: UsageInfo | None = None  # of the output being rendered, with continuous_usage
        self.created = int(time.time())
        self.started: set[int] = set()
        self.tool_streams: dict[int, Any] = {}  # auto: each choice's parser stream (HermesStream's interface)
        self.constrained: dict[int, ConstrainedCallStream] = {}
        self.splits: dict[int, ReasoningStream | None] = {}  # with a reasoning parser: each choice's splitter
        self.reasoning_counts: dict[int, int] = {}

    def events(self, group: RequestGroup) -> AsyncIterator[str]:
        counts = (lambda: list(self.reasoning_counts.values())) if self.serving.reasoning_format() else (lambda: None)
        return stream_events(group, self.render, (lambda accs: self.chunk(
            [], with_reasoning(usage([len(self.prompt)], accs, self.params.n), counts())))
            if self.include_usage else None)

    def chunk(self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None,
              prompt_token_ids: list[int] | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.rid, created=self.created, model=self.serving.state.model_name,
                                       choices=choices, usage=usage or self.usage_now,
                                       prompt_token_ids=prompt_token_ids))

    def logprobs(self, out: TokenOut | Accumulated) -> ChatLogprobs | None:
        return self.serving.chat_logprobs(out, self.req.return_tokens_as_token_ids) if self.params.logprobs else None

    def render(self, index: int, out: TokenOut, acc: Accumulated) -> Iterator[str]:
        if self.continuous_usage:
            self.usage_now = usage([len(self.prompt)], [acc], 1)
        if index not in self.started:
            yield from self.start(index)
        thinking = ""
        if index not in self.splits:
            self.splits[index] = self.serving.reasoning_stream(self.prompt, self.tools)
        split = self.splits[index]
        if split is not None:  # the thinking goes out as reasoning_content; the rest of the way sees the answer
            thinking, answer = split.feed(out.text)
            if out.finish_reason is not None:
                more = split.finish()
                thinking, answer = thinking + more[0], answer + more[1]
                self.reasoning_counts[index] = split.reasoning_tokens(acc.token_ids, self.serving.manager.tokenizer)
            out = dataclasses.replace(out, text=answer)
        if self.tools is not None and thinking:
            yield self.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(
                reasoning_content=thinking, reasoning=thinking))])
        if self.tools is not None and self.tools.auto:
            yield from self.render_auto(index, out, acc)
        elif self.tools is not None:
            yield from self.render_constrained(index, out, acc)
        elif out.text or thinking or out.finish_reason is not None or out.logprobs or (
                self.req.return_token_ids and out.token_ids):
            yield self.chunk([ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(content=out.text or None, reasoning_content=thinking or None,
                                                reasoning=thinking or None), logprobs=self.logprobs(out),
                finish_reason=finish_reason_str(out.finish_reason), matched_stop=matched(out.finish_reason),
                token_ids=(out.token_ids or None) if self.req.return_token_ids else None)])

    def start(self, index: int) -> Iterator[str]:
        """The first chunks of a choice: its role (with the prompt's ids if asked), then the echo if any."""
        self.started.add(index)
        # with continuous usage, the role chunk counts no completion token yet (as vLLM's)
        role_usage = UsageInfo(prompt_tokens=len(self.prompt), completion_tokens=0, total_tokens=len(self.prompt)) \
            if self.continuous_usage else None
        yield self.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                         usage=role_usage, prompt_token_ids=self.prompt if self.req.return_token_ids else None)
        echo = echo_text(self.req)
        if echo:
            yield self.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=echo))])

    def render_constrained(self, index: int, out: TokenOut, acc: Accumulated) -> Iterator[str]:
        """A named function or "required": each call starts once its name is known, then its arguments
        stream as they are written (as vLLM), with their tokens' logprobs if asked."""
        assert self.tools is not None
        scan = self.constrained.setdefault(index, ConstrainedCallStream(self.tools.named))
        deltas = scan.feed(out.text)
        content = finish = None
        if out.finish_reason is not None:
            split = self.splits.get(index)
            _, finish, content = calls_of(self.tools, acc, text=split.answer_text if split is not None else None)
            if scan.calls:  # calls went out already; a cut-off list is not also sent as text
                content = None
        if deltas or content or finish or (self.params.logprobs and out.logprobs):
            yield self.chunk([ChatCompletionStreamChoice(
                index=index, finish_reason=finish, logprobs=self.logprobs(out),
                delta=DeltaMessage(content=content, tool_calls=deltas or None))])

    def render_auto(self, index: int, out: TokenOut, acc: Accumulated) -> Iterator[str]:
        """Auto (the --tool-call-parser's format): the text before the model starts a call streams as content,
        the calls follow as they are written, and the last delta has any text after them (and the logprobs)."""
        assert self.tools is not None
        if index not in self.tool_streams:
            self.tool_streams[index] = self.tools.parser.stream()
        parser = self.tool_streams[index]
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
