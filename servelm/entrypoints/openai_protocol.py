"""Pydantic models of the OpenAI-compatible API and the native endpoints.

Requests ignore unknown fields (as the OpenAI API and vLLM do) so that newer
clients keep working; types are checked by pydantic and ranges by
`SamplingParams.validate`, both surfacing as a 400 that names the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from servelm.constrained import check_schema_depth


def random_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. `chatcmpl-<hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _bounded_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is not None:
        check_schema_depth(schema, "schema")
    return schema


def invalid_text_path(value: Any) -> str | None:
    """The path (`a.0.b`) of the first string in `value` (dict keys too) that is not valid Unicode text:
    JSON's "\\ud800" (a lone UTF-16 surrogate) decodes to one, and no tokenizer or response can carry it.
    None when all text is valid. Iterative, whatever the nesting; the path itself is always printable."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return (path or "body").encode("utf-8", "replace").decode()
        elif isinstance(item, dict):
            for key, child in item.items():
                sub = f"{path}.{key}" if path else str(key)
                stack += [(key, sub), (child, sub)]
        elif isinstance(item, list):
            stack.extend((child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item))
    return None


# Extensions of vLLM and SGLang that clients send and servelm does not implement yet: named as such in the
# 400, rather than "unrecognized" (and never dropped silently, which would change what the client asked for).
UNSUPPORTED_EXTENSIONS = frozenset({
    "guided_decoding_backend", "include_stop_str_in_output", "spaces_between_special_tokens", "length_penalty",
    "early_stopping", "priority", "documents", "mm_processor_kwargs", "chat_template", "lora_path", "image_data",
    "audio_data", "video_data", "session_params", "custom_logit_processor", "request_id", "cache_salt",
    "allowed_token_ids", "bad_words", "lora_request", "vllm_xargs", "kv_transfer_params",
})


def _only(default: Any, why: str) -> AfterValidator:
    """A field that SGLang's and vLLM's routers (sgl-router, SMG, vllm-router) add to every request they forward,
    at its default: accepted at that value; any other is a 400 that says why."""

    def check(value: Any) -> Any:
        if value != default:
            raise ValueError(f"only {str(default).lower() if isinstance(default, bool) else default!r} is "
                             f"supported: {why}")
        return value

    return AfterValidator(check)


_NO_HIDDEN = _only(False, "servelm does not return hidden states yet")


def unknown_fields_message(names: list[str]) -> str:
    """The 400 message for request fields that are neither OpenAI's nor an extension servelm implements."""
    known = [n for n in names if n in UNSUPPORTED_EXTENSIONS]
    if known:
        return (f"{', '.join(repr(n) for n in known)}: {'a vLLM/SGLang extension' if len(known) == 1 else 'extensions'}"
                " that servelm does not support yet")
    return f"Unrecognized request argument{'s' if len(names) > 1 else ''} supplied: {', '.join(names)}"


class _TopRequest(_Request):
    """A request body: unknown fields are a 400 (as OpenAI: a typo like `max_token` must not run with the
    default instead), and its text must be valid Unicode (checked once, for the whole body). Nested objects
    (messages, tools, ...) still ignore fields they do not know."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        path = invalid_text_path(data)
        if path is not None:
            raise PydanticCustomError("invalid_text", "{path}: not valid Unicode text (a lone UTF-16 surrogate?)",
                                      {"path": path})
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- errors
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ------------------------------------------------------------- requests
class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) on every chunk too, with include_usage


class StructuredOutputs(_TopRequest):
    """vLLM's `structured_outputs` object: at most one of json, regex, choice, grammar, json_object. Unknown
    keys are a 400 (a constraint servelm does not know must not be dropped)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    _depth = field_validator("json_")(lambda v: _bounded_schema(v) if isinstance(v, dict) else v)


class ContentPart(_Request):
    type: str = "text"
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this result answers

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    _depth = field_validator("schema_")(_bounded_schema)


class ResponseFormat(_Request):
    """OpenAI's structured-output switch: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # json_object with a schema (llama.cpp, Together and instructor <= 1.3 send it): the schema is enforced.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    _depth = field_validator("schema_")(_bounded_schema)


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None

    _depth = field_validator("parameters")(_bounded_schema)


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class _SamplingFields(_TopRequest):
    """Sampling fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # as vLLM's: pydantic's bounds name the check
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: str | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    # Constraints (at most one, with response_format; serving_base.constraint_of): SGLang's and vLLM's spellings.
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    stop_regex: str | list[str] | None = None  # SGLang: stop once the output matches one of these
    # vLLM: the prompt's logprobs (this many alternatives each), token ids in the response, logprob tokens as
    # "token_id:N", keep only the last N prompt tokens (-1: as many as fit the context).
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: which end truncate_prompt_tokens cuts
    use_beam_search: bool = False  # refused when true: servelm has no beam search
    # What the routers add (at these values) to every request they forward; other values are refused.
    return_hidden_states: Annotated[bool, _NO_HIDDEN] = False
    no_stop_trim: Annotated[bool, _only(False, "the stop string is always trimmed from the output")] = False
    # OpenAI fields that change nothing a local server does: accepted and ignored.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: "required" makes exactly one call
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM/SGLang: extra variables of the chat template
    echo: bool = False  # vLLM: the reply starts with the last message's content when it has the reply's role
    # OpenAI fields: modalities may only ask for text; audio output is refused; the others change nothing here.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    # SGLang's and vLLM's reasoning switches, sent by the routers at their defaults: the reasoning parser (when the
    # server has one) always splits the thinking out, and streams it as it comes.
    separate_reasoning: Annotated[bool, _only(True, "the reasoning parser always separates the thinking")] = True
    stream_reasoning: Annotated[bool, _only(True, "the thinking is always streamed as it comes")] = True
    include_reasoning: Annotated[bool, _only(True, "reasoning_content is always returned")] = True


class CompletionRequest(_SamplingFields):
    # Text, token ids, a batch of texts, or a batch of token-id lists.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # legacy OpenAI: only 1 (or n) is served


class GenerateRequest(_TopRequest):
    """Native `/generate` (SGLang-style): `text` or `input_ids`, one or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None
    # SGLang: logprobs in meta_info as [logprob, token_id, text-or-null], of the prompt from logprob_start_len
    # (-1: none of it) and of the output, with top_logprobs_num alternatives each.
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    # Fields SGLang's routers add when they forward /generate: `model` (a router's "unknown", or null: one model is
    # served here either way) and logging switches are ignored; the rest are accepted at their defaults.
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: Annotated[bool, _NO_HIDDEN] = False
    background: Annotated[bool, _only(False, "requests always run in the foreground")] = False
    return_bytes: Annotated[bool, _only(False, "text is returned as text")] = False
    return_entropy: Annotated[bool, _only(False, "servelm does not return entropies yet")] = False


class TokenizeRequest(_TopRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: render the last message open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_TopRequest):
    model: str | None = None
    tokens: list[int]


class AbortRequest(_TopRequest):
    rid: str


# ------------------------------------------------------------ responses
class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0  # output tokens of the thinking, its closing marker included (--reasoning-parser)


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None  # the next piece of the JSON text


class DeltaToolCall(_Response):
    """One piece of a streamed call: the first carries id, type and name; later ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking, with --reasoning-parser (SGLang's and vLLM's name)
    reasoning: str | None = None  # the same text under newer vLLM's name
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's prompt_logprobs (on the response)
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # the next piece of the thinking, with --reasoning-parser
    reasoning: str | None = None  # the same piece under newer vLLM's name
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk, with return_token_ids


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's prompt_logprobs (per choice)
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "servelm"
    root: str | None = None
    max_model_len: int | None = None
    # what it does: generate, embed (/v1/embeddings) or score (a cross-encoder's /v1/rerank)
    task: str | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
