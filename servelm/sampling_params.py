"""Per-request sampling parameters, validated in one place.

The HTTP server turns a `SamplingParamsError` into a 400 naming the field;
the offline Engine raises it to the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import regex


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_STOP_REGEX = 16
MAX_STOP_REGEX_CHARS = 1024


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
    # Also score the prompt: the logprob (and top alternatives) of each prompt token after the first, given
    # the tokens before it (OpenAI completions' echo with logprobs; vLLM's prompt_logprobs).
    prompt_logprobs: bool = False
    prompt_top_logprobs: int | None = None  # alternatives per prompt token; None: as many as top_logprobs
    # Structured output, at most one: a JSON schema (as a JSON string), a regular expression or an EBNF grammar
    # (Lark or GBNF) that the generated text must match (servelm.constrained); whitespace_pattern: the
    # whitespace a JSON schema allows (vLLM's).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    whitespace_pattern: str | None = None
    # With a reasoning parser, the constraint applies to the answer after the thinking: [end marker id] (the
    # output starts inside the thinking), or [start id, end id] (its first token may open a block); [] always.
    constraint_after: list[int] = field(default_factory=list)
    # SGLang's stop_regex: stop once the output text matches one of these (the match stays in the text).
    stop_regex: list[str] = field(default_factory=list)
    # OpenAI's logit_bias: token id -> value added to its logit before sampling, in [-100, 100].
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = list(self.stop_regex or [])
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
        for name in ("top_logprobs", "prompt_top_logprobs"):  # the server's limit was applied by the API
            error = top_logprobs_error(getattr(self, name), name, vocab_size)
            if error:
                bad(name, error)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            bad("seed", f"seed must be in [-2^63, 2^63 - 1], got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop must be a non-empty string or a list of non-empty strings")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size})")
        bad_keys = [k for k in self.logit_bias
                    if not isinstance(k, int) or (vocab_size is not None and not 0 <= k < vocab_size)]
        if bad_keys:
            bad("logit_bias", f"logit_bias keys must be token ids in [0, {vocab_size}), got "
                              f"{', '.join(repr(k) for k in bad_keys)}")
        for token, value in self.logit_bias.items():
            if not isinstance(value, (int, float)) or not -100 <= value <= 100:
                bad("logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} for token {token}")
        if len(self.stop_regex) > MAX_STOP_REGEX or any(len(str(p)) > MAX_STOP_REGEX_CHARS for p in self.stop_regex):
            # Each is searched over the output after every token, in the scheduler loop: bound the work.
            bad("stop_regex", f"stop_regex: at most {MAX_STOP_REGEX} patterns of at most {MAX_STOP_REGEX_CHARS} "
                              "characters each")
        for pattern in self.stop_regex:
            try:
                regex.compile(pattern)
            except (regex.error, TypeError) as exc:
                bad("stop_regex", f"stop_regex: not a valid regular expression: {pattern!r} ({exc})")
        self.grammar()

    def grammar(self) -> str | None:
        """The llguidance grammar of json_schema / regex (None without one); SamplingParamsError if malformed."""
        from servelm.constrained import grammar_of

        key = (self.json_schema, self.regex, self.ebnf, self.whitespace_pattern)
        cached = self.__dict__.get("_grammar")  # validate() and the scheduler both ask: compile once
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            grammar = grammar_of(*key)
        except ValueError as exc:
            param, _, message = str(exc).partition(": ")
            raise SamplingParamsError(param, f"{param}: {message}") from None
        self.__dict__["_grammar"] = (key, grammar)
        return grammar

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, its lists and dicts copied. NOTE: what `dataclasses.asdict` returns, which walked
        every field recursively: ~40% of the API process's CPU time for an embedding request (py-spy, a 2-core
        Zen 3 EPYC); the fields are scalars, lists of str/int and a dict of numbers, so one shallow copy each."""
        out = {}
        for name in _FIELD_NAMES:
            value = getattr(self, name)
            kind = type(value)
            out[name] = list(value) if kind is list else dict(value) if kind is dict else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise SamplingParamsError(sorted(unknown)[0], f"unknown sampling parameter: {', '.join(sorted(unknown))}")
        return cls(**data)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))


# ------------------------------------------------------------------ request checks
# One home for the checks that the API (a 400 naming the field) and the scheduler (its safety net) both make.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit signed integer, as vLLM's
MAX_TOP_LOGPROBS = 20


def top_logprobs_error(value: int | None, param: str = "top_logprobs", limit: int = MAX_TOP_LOGPROBS) -> str | None:
    """Why `value` cannot be a number of top alternatives (top_logprobs, completions' logprobs), or None.
    `limit`: the server's --max-logprobs (-1: any number, and -1 asks for the whole vocabulary)."""
    if value is None or (0 <= value <= limit) or (limit == -1 and value >= -1):
        return None
    if value == -1:
        return (f"{param} -1 (the whole vocabulary) needs the server started with --max-logprobs -1; this one "
                f"allows at most {limit}")
    return f"{param} must be in [0, {limit}], got {value}"


def token_ids_error(ids: Sequence[int], vocab_size: int, what: str = "prompt") -> str | None:
    """Why `ids` cannot be a prompt (empty, or a token outside the vocabulary), or None."""
    if not ids:
        return f"{what} must not be empty"
    for pos, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            return f"{what}: token id {token} at position {pos} is out of range [0, {vocab_size})"
    return None


def context_length_error(prompt_len: int, max_new_tokens: int | None, context_length: int,
                         prompt: str = "prompt", limit: str = "max_tokens",
                         model_context: int | None = None) -> str | None:
    """Why a prompt of `prompt_len` tokens (plus `max_new_tokens`, when known) does not fit the model's
    context, or None. `prompt` and `limit` name the request's fields in the message. SGLang's sentence comes
    first (clients match on it), then OpenAI's. `model_context`: the model's own context length when
    `context_length` is less because the KV pool holds fewer tokens; the message then names both sizes."""
    if not context_length:
        return None
    if prompt_len >= context_length:
        pool = ""
        if model_context and model_context > context_length:
            pool = (f" The KV cache pool holds {context_length} tokens, fewer than the model's context length of "
                    f"{model_context}: a larger pool (--cpu-kv-cache-gb, --mem-fraction-static on a GPU, "
                    "--max-total-tokens) or a --kv-cache-dtype of fewer bytes makes room.")
        return (f"The input ({prompt_len} tokens) is longer than the model's context length ({context_length} "
                f"tokens). This model's maximum context length is {context_length} tokens. However, the {prompt} "
                f"has {prompt_len} tokens. Please reduce the length of the {prompt}.{pool}")
    if max_new_tokens is not None and prompt_len + max_new_tokens > context_length:
        total = prompt_len + max_new_tokens
        return (f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
                f"You requested a total of {total} tokens: {prompt_len} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit. (OpenAI: you requested {total} tokens "
                f"({prompt_len} in the {prompt}, {max_new_tokens} in the completion). Please reduce the length "
                f"of the {prompt} or {limit}.)")
    return None


def input_length_error(length: int, limit: int, what: str = "input") -> str | None:
    """Why an input of `length` tokens cannot be embedded whole by a model that reads at most `limit`, or
    None (an embedding model's whole context is the input: `limit` tokens fit)."""
    if length <= limit:
        return None
    return (f"The input ({length} tokens) is longer than the model's context length ({limit} tokens). Shorten the "
            f"{what}, or pass truncate_prompt_tokens (at most {limit}) to cut it.")


# ----------------------------------------------------------------- one step's rows (scheduler -> sampler)
@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    sample_index: int
    position: int  # position of the token being sampled
    prompt_ids: list[int]
    output_ids: list[int]
    banned_ids: list[int] = field(default_factory=list)  # e.g. EOS before min_new_tokens
    # A scoring row (prompt logprobs): the token at `position` is given; report its raw logprob and the
    # top alternatives instead of drawing one.
    target: int | None = None
    # A constrained request's allowed next tokens, as llguidance's bitmask (servelm.constrained).
    allowed: bytes | None = None

    @property
    def wants_logprob(self) -> bool:
        return self.params.logprobs or self.target is not None


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    # Scored prompt tokens (rows with a target): the token's rank in the whole distribution (1 = the most
    # likely; vLLM's prompt_logprobs rank, also outside the top k); None for the other rows.
    ranks: list[int | None] = field(default_factory=list)
    # A decoder embedder's pooled rows (StepInput.hidden_indices): each one's embedding, float32 in base64.
    hidden: list[str] = field(default_factory=list)
