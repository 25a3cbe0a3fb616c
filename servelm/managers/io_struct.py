"""Typed messages between the API process and the scheduler process.

Every message is a dataclass of plain fields. `encode`/`decode` are the one
serialiser: JSON of `{"type": <class name>, "data": {...}}`, so nothing but
these classes can cross the socket (no pickle of arbitrary objects).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateReq:
    """A tokenized request. `sample_index` separates the n samples of one
    user request so each draws its own, reproducible, random stream."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    stream: bool = False
    sample_index: int = 0


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


@dataclass
class ServerInfoReq:
    pass


@dataclass
class ServerInfoOut:
    info: dict[str, Any]


@dataclass
class TokenOut:
    """What one request produced in one scheduler step.

    `text` is the newly detokenized text (stop strings already trimmed);
    `finish_reason` is None while running, else {"type": "stop"|"length"|"abort",
    "matched": <stop string or token id or None>, "message": str?}.
    """

    rid: str
    token_ids: list[int]
    text: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Once, in a request's first output, when it asked for prompt logprobs: one entry per prompt token,
    # None for the first (nothing before it to condition on).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class BatchTokenOut:
    outputs: list[TokenOut]


_TYPES = {cls.__name__: cls for cls in (GenerateReq, AbortReq, FlushCacheReq, FlushCacheOut, ServerInfoReq,
                                         ServerInfoOut, TokenOut, BatchTokenOut)}


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if name not in _TYPES:
        raise TypeError(f"not a servelm message: {name}")
    return json.dumps({"type": name, "data": dataclasses.asdict(msg)}).encode()


def decode(raw: bytes) -> Any:
    obj = json.loads(raw)
    cls = _TYPES[obj["type"]]
    data = obj["data"]
    if cls is BatchTokenOut:
        return BatchTokenOut([TokenOut(**o) for o in data["outputs"]])
    return cls(**data)
