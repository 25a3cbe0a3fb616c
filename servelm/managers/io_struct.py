"""Typed messages between the API process and the scheduler process.

Every message is a dataclass of plain fields. `encode`/`decode` are the one
serialiser: JSON of `{"type": <class name>, "data": {...}}`, so nothing but
these classes can cross the socket (no pickle of arbitrary objects).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal


@dataclass
class GenerateReq:
    """A tokenized request. `sample_index` separates the n samples of one
    user request so each draws its own, reproducible, random stream."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    stream: bool = False
    sample_index: int = 0
    # Scoring (SGLang's /v1/score): the logprobs of these token ids at the position after the prompt, reported
    # in the final TokenOut's `label_logprobs` (with max_new_tokens 0, nothing is generated).
    label_token_ids: list[int] | None = None
    # An encoder's token types (BERT's segment ids: a cross-encoder's query 0, document 1); None: all 0.
    token_type_ids: list[int] | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""
    dp_rank: int = 0  # the replica that answers (--dp-size)


@dataclass
class ServerInfoReq:
    pass


@dataclass
class ServerInfoOut:
    info: dict[str, Any]
    dp_rank: int = 0


@dataclass(frozen=True)
class FinishReason:
    """Why a request stopped (as SGLang's FINISH_* classes and vLLM's FinishReason).

    `stop`: an EOS or stop token (`matched` is its id), a stop string (`matched` is the string) or a complete
    constraint (`matched` None); `length`: max_new_tokens or the context length; `abort`: the client hung up
    or asked (`message` "aborted"), or the request failed (`message` says why; `internal` when the fault is
    ours, which a client gets as a 503, not a 400).
    """

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None
    internal: bool = False

    ABORTED: ClassVar[str] = "aborted"  # the message of an abort that a client asked for

    @classmethod
    def stop(cls, matched: int | str | None = None) -> FinishReason:
        return cls("stop", matched)

    @classmethod
    def length(cls) -> FinishReason:
        return cls("length")

    @classmethod
    def abort(cls, message: str = ABORTED, internal: bool = False) -> FinishReason:
        return cls("abort", message=message, internal=internal)

    @property
    def is_failure(self) -> bool:
        """An abort that is an error to report (the request failed), not one that a client asked for."""
        return self.type == "abort" and self.message not in (None, self.ABORTED)

    def to_dict(self) -> dict[str, Any]:
        """The wire format of /generate's meta_info and the Engine: {"type", "matched", "message"?}."""
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message is not None:
            out["message"] = self.message
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinishReason:
        return cls(data["type"], data.get("matched"), data.get("message"), bool(data.get("internal", False)))


@dataclass
class TokenOut:
    """What one request produced in one scheduler step.

    `text` is the newly detokenized text (stop strings already trimmed); `finish_reason` is None while the
    request runs.
    """

    rid: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Once, in a request's first output, when it asked for prompt logprobs: one entry per prompt token,
    # None for the first (nothing before it to condition on).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank in its distribution (1 = top)
    # In the final output of a request with label_token_ids: one logprob per label token id.
    label_logprobs: list[float] | None = None
    # In the final output: seconds the request spent queued, prefilling (to its first token) and decoding
    # (first to last token), as the scheduler measured them (vLLM's request_*_time_seconds).
    timings: dict[str, float] | None = None
    # An embedding server's output (its only one): the input's embedding, float32 little-endian in base64.
    embedding: str | None = None


@dataclass
class BatchTokenOut:
    outputs: list[TokenOut]
    # The scheduler's steps since its last message: tokens each step ran (vLLM's iteration_tokens_total),
    # and how many requests it retracted (preemptions).
    iteration_tokens: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # With data-parallel replicas: which one sent this, and what its prefix cache gained and lost since its
    # last message (RadixCache.events), for the API process's mirror of it.
    dp_rank: int = 0
    cache_events: list[list[Any]] = field(default_factory=list)


_TYPES = {cls.__name__: cls for cls in (GenerateReq, AbortReq, FlushCacheReq, FlushCacheOut, ServerInfoReq,
                                         ServerInfoOut, TokenOut, BatchTokenOut)}


_FIELDS: dict[type, tuple[str, ...]] = {}


def _plain(value: Any) -> Any:
    """`value` as JSON's types: dataclasses (and lists of them) become dicts; other values are left as they are
    for json.dumps (NOTE: dataclasses.asdict deep-copies every list and dict, which was 15% of an embedding
    request's API CPU)."""
    cls = type(value)
    names = _FIELDS.get(cls)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        return {n: _plain(getattr(value, n)) for n in names}
    if cls is list and value and dataclasses.is_dataclass(value[0]):
        return [_plain(v) for v in value]
    return value


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if name not in _TYPES:
        raise TypeError(f"not a servelm message: {name}")
    return json.dumps({"type": name, "data": _plain(msg)}).encode()


def decode(raw: bytes) -> Any:
    obj = json.loads(raw)
    cls = _TYPES[obj["type"]]
    data = obj["data"]
    if cls is BatchTokenOut:
        return BatchTokenOut(**{**data, "outputs": [_token_out(o) for o in data["outputs"]]})
    if cls is TokenOut:
        return _token_out(data)
    return cls(**data)


def _token_out(data: dict[str, Any]) -> TokenOut:
    reason = data.get("finish_reason")
    return TokenOut(**{**data, "finish_reason": None if reason is None else FinishReason.from_dict(reason)})


@dataclass
class OutputAccumulator:
    """Everything one request produced so far, gathered from its TokenOuts: what the HTTP server answers a
    non-streamed request with, and what the offline Engine returns."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    label_logprobs: list[float] | None = None
    embedding: str | None = None

    def add(self, out: TokenOut) -> None:
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.label_logprobs is not None:
            self.label_logprobs = out.label_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
            self.prompt_ranks = out.prompt_ranks
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.top_logprobs.extend(out.top_logprobs)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason

    @property
    def full_text(self) -> str:
        return "".join(self.text)
