"""Per-request sampling parameters, validated in one place.

The HTTP server turns a `SamplingParamsError` into a 400 naming the field;
the offline Engine raises it to the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    # Also score the prompt: the logprob (and top_logprobs alternatives) of each prompt token after the
    # first, given the tokens before it (OpenAI completions' echo with logprobs; vLLM's prompt_logprobs).
    prompt_logprobs: bool = False
    # Structured output, at most one: a JSON schema (as a JSON string) or a regular expression that the
    # generated text must match (servelm.constrained).
    json_schema: str | None = None
    regex: str | None = None
    # OpenAI's logit_bias: token id -> value added to its logit before sampling, in [-100, 100].
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        # JSON object keys are strings ("50256": -100): keep ids as ints; a bad key fails validation.
        bias = {}
        for key, value in dict(self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except (TypeError, ValueError):
                bias[key] = value
        self.logit_bias = bias

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError on the first out-of-range field."""
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, msg)

        # 0 only prefills: it scores the prompt (prompt_logprobs) and generates nothing, as legacy OpenAI
        # completions with echo and SGLang's native API allow; the chat API asks for at least 1 itself.
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad("max_tokens", f"max_tokens must be non-negative, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            bad("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_new_tokens}")
        if self.temperature < 0:
            bad("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 1 <= self.n <= 128:
            bad("n", f"n must be in [1, 128], got {self.n}")
        if not 0 <= self.top_logprobs <= 20:
            bad("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop must be a non-empty string or a list of non-empty strings")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size})")
        for token, value in self.logit_bias.items():
            if not isinstance(token, int) or (vocab_size is not None and not 0 <= token < vocab_size):
                bad("logit_bias", f"logit_bias keys must be token ids in [0, {vocab_size}), got {token!r}")
            if not isinstance(value, (int, float)) or not -100 <= value <= 100:
                bad("logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} for token {token}")
        self.grammar()

    def grammar(self) -> str | None:
        """The llguidance grammar of json_schema / regex (None without one); SamplingParamsError if malformed."""
        from servelm.constrained import grammar_of

        key = (self.json_schema, self.regex)
        cached = self.__dict__.get("_grammar")  # validate() and the scheduler both ask: compile once
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            grammar = grammar_of(self.json_schema, self.regex)
        except ValueError as exc:
            param, _, message = str(exc).partition(": ")
            raise SamplingParamsError(param, f"{param}: {message}") from None
        self.__dict__["_grammar"] = (key, grammar)
        return grammar

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise SamplingParamsError(sorted(unknown)[0], f"unknown sampling parameter: {', '.join(sorted(unknown))}")
        return cls(**data)


# ------------------------------------------------------------------ request checks
# One home for the checks that the API (a 400 naming the field) and the scheduler (its safety net) both make.
def token_ids_error(ids: Sequence[int], vocab_size: int, what: str = "prompt") -> str | None:
    """Why `ids` cannot be a prompt (empty, or a token outside the vocabulary), or None."""
    if not ids:
        return f"{what} must not be empty"
    for pos, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            return f"{what}: token id {token} at position {pos} is out of range [0, {vocab_size})"
    return None


def context_length_error(prompt_len: int, max_new_tokens: int | None, context_length: int,
                         prompt: str = "prompt", limit: str = "max_tokens") -> str | None:
    """Why a prompt of `prompt_len` tokens (plus `max_new_tokens`, when known) does not fit the model's
    context, or None. `prompt` and `limit` name the request's fields in the message."""
    if not context_length:
        return None
    if prompt_len >= context_length:
        return (f"This model's maximum context length is {context_length} tokens. However, the {prompt} has "
                f"{prompt_len} tokens. Please reduce the length of the {prompt}.")
    if max_new_tokens is not None and prompt_len + max_new_tokens > context_length:
        return (f"This model's maximum context length is {context_length} tokens. However, you requested "
                f"{prompt_len + max_new_tokens} tokens ({prompt_len} in the {prompt}, {max_new_tokens} in the "
                f"completion). Please reduce the length of the {prompt} or {limit}.")
    return None
