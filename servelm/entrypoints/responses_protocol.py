"""Pydantic models of OpenAI's Responses API (`/v1/responses`): text and function calls in, text, reasoning and
function calls out.

Requests reuse `openai_protocol`'s base classes (unknown top-level fields are a 400); responses follow the
shapes of the `openai` package's `types.responses` (Response, ResponseOutputMessage, the streaming events).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from servelm.entrypoints.openai_protocol import JsonSchemaFormat, _Request, _Response, _TopRequest, random_id


class InputText(_Request):
    """One content part of an input message (`input_text`; an earlier turn's `output_text`)."""

    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallInput(_Request):
    """An earlier turn's call (as the response's `function_call` output item), sent back with the input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputInput(_Request):
    """The result of a call the model made: `call_id` names it."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = InputMessage | FunctionCallInput | FunctionCallOutputInput


class FunctionTool(_Request):
    """A function tool, as the Responses API spells it (flat: name and parameters beside `type`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    """`text.format`: free text, any JSON object, or JSON following `schema` (constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(_Request):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(_TopRequest):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # SGLang's sampling extras on this endpoint
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    # "auto": the oldest input items are dropped until the input fits the context; "disabled": a 400
    truncation: Literal["disabled", "auto"] | None = None
    text: TextConfig | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields that change nothing a local server does: accepted and kept.
    metadata: dict[str, str] | None = None
    user: str | None = None


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str = Field(default_factory=lambda: random_id("msg").replace("-", "_"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Response):
    """The model's thinking (with --reasoning-parser), before its message, as OpenAI's reasoning item."""

    id: str = Field(default_factory=lambda: random_id("rs").replace("-", "_"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class FunctionCallItem(_Response):
    """A call the model made (the `function_call` output item)."""

    id: str = Field(default_factory=lambda: random_id("fc").replace("-", "_"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseUsage(_Response):
    input_tokens: int
    # cached_tokens: read from the prefix cache; cache_write_tokens: the prompt tokens this response added to it
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int
    prompt_tokens: int = 0  # the chat API's names of input_tokens and output_tokens (SGLang reports both)
    completion_tokens: int = 0


Status = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]


class ResponseObject(_Response):
    """OpenAI's `Response`."""

    id: str = Field(default_factory=lambda: random_id("resp").replace("-", "_"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Status = "in_progress"
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool = False
    tool_choice: str | dict[str, Any] = "none"
    truncation: Literal["disabled", "auto"] = "disabled"
    tools: list[Any] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "incomplete", "cancelled", "failed")
