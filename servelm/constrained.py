"""Constrained decoding (structured outputs) with llguidance.

A request may carry one constraint in its sampling params: `json_schema` (a
JSON schema as a string; OpenAI's `response_format` maps onto it) or `regex`.
The scheduler keeps one `LLMatcher` per request: before each draw it asks the
matcher for the bitmask of allowed next tokens (sent with the sampling row,
so it also reaches other TP ranks), and after the draw it feeds the token
back. When the grammar can take no further token the request stops.

llguidance is imported lazily: requests without a constraint never load it; nor does the API process
import torch through this module (it only validates).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Compact JSON with single spaces after separators: without a bound on whitespace a weak model can pad
# forever between tokens of the grammar.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Deeper JSON would exhaust Python's recursion in the JSON and grammar code; no real schema comes close.
MAX_SCHEMA_DEPTH = 100


def check_schema_depth(schema: Any, param: str = "json_schema") -> None:
    """ValueError (naming `param`) when `schema` nests objects/arrays more than MAX_SCHEMA_DEPTH deep.

    Iterative, so that it cannot itself run out of recursion.
    """
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{param}: nested more than {MAX_SCHEMA_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children)


# Keywords whose value is a subschema or a list of them, or a name -> subschema map.
_SUBSCHEMAS = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "additionalItems", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any, close: bool = True) -> Any:
    """A copy of `schema` where every object that declares `properties` forbids undeclared ones, unless it
    says otherwise (`additionalProperties` or `unevaluatedProperties` given), as vLLM's default grammar
    backend compiles schemas: JSON Schema's own default lets a weak model invent keys until max_tokens.

    Objects without `properties` (e.g. `{"type": "object"}`, json_object mode) stay open, and so do the
    branches of an `allOf` themselves (each names only part of the object's properties).
    """
    if isinstance(schema, list):
        return [strict_schema(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = strict_schema(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = strict_schema(out["allOf"], close=False)
    if close and isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_of(json_schema: str | None, regex: str | None, ebnf: str | None = None,
               whitespace_pattern: str | None = None) -> str | None:
    """The llguidance grammar of a request's constraint (a JSON schema, a regular expression, or an EBNF grammar
    in Lark or GBNF syntax, as llguidance reads them), or None when it has none. `whitespace_pattern` (vLLM's)
    is the regex of the whitespace a JSON schema allows between tokens.

    Raises ValueError (naming the parameter) when the constraint is malformed or there is more than one.
    """
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf))
             if value is not None]
    if not given:
        return None
    from llguidance import LLMatcher

    if len(given) > 1:
        raise ValueError(f"{given[0]}: give at most one of json_schema, regex and ebnf (got {', '.join(given)})")
    param = given[0]
    if json_schema is not None:
        grammar = _json_grammar(json_schema, whitespace_pattern)
    elif regex is not None:
        grammar = LLMatcher.grammar_from_regex(regex)
    else:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(ebnf))  # type: ignore[arg-type]
        except Exception as exc:  # the GBNF converter raises plain Exceptions too (e.g. no root rule)
            raise ValueError(f"ebnf: {(str(exc).strip().splitlines() or ['not a valid grammar'])[0]}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{param}: {error.strip().splitlines()[0]}")
    return grammar


def _json_grammar(json_schema: str, whitespace_pattern: str | None) -> str:
    from llguidance import LLMatcher

    try:
        schema = json.loads(json_schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema: not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"json_schema: nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
    if not isinstance(schema, dict):
        raise ValueError("json_schema: a JSON schema must be a JSON object")
    check_schema_depth(schema)
    options: dict[str, Any] = dict(JSON_OPTIONS)
    if whitespace_pattern is not None:
        options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    return LLMatcher.grammar_from_json_schema(strict_schema(schema), defaults=options)


def choice_regex(choices: list[str]) -> str:
    """A regular expression matching exactly one of `choices` (vLLM's guided_choice)."""
    return "|".join(f"(?:{re.escape(c)})" for c in choices)


class GrammarFactory:
    """Matchers over one model's tokenizer (the llguidance tokenizer is built once, on first use)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None

    def matcher(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids or None)
        matcher = LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the constraint cannot be used with this tokenizer: {matcher.get_error()}")
        return matcher


def allowed_tokens(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (bit j of 32-bit word w allows token 32 * w + j) -> bool [vocab_size]."""
    import torch

    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32)
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab_size].bool()
