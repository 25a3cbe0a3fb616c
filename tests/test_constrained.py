"""The grammar helpers of structured outputs (servelm.constrained), without a model."""

from __future__ import annotations

import json

import pytest
import torch

from servelm.constrained import allowed_tokens, check_schema_depth, choice_regex, grammar_of


def test_grammar_of_a_schema_a_regex_or_nothing() -> None:
    assert grammar_of(None, None) is None
    assert grammar_of(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}), None)
    assert grammar_of(None, r"(yes|no)-[0-9]{2}")


@pytest.mark.parametrize(("schema", "regex", "message"), [
    ('{"type": "object"}', "a", "json_schema: give at most one of json_schema, regex and ebnf"),
    ("{not json", None, "json_schema: not valid JSON"),
    ("[1, 2]", None, "json_schema: a JSON schema must be a JSON object"),
    ('{"type": "nonsense"}', None, "json_schema: "),
    (None, "(ab", "regex: "),
])
def test_malformed_constraints_name_their_parameter(schema: str | None, regex: str | None, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        grammar_of(schema, regex)
    assert str(exc.value).startswith(message)


def test_depth_is_checked_without_recursion() -> None:
    check_schema_depth({"a": [[{"b": 1}]]})
    deep: object = {}
    for _ in range(10_000):
        deep = {"items": deep}
    with pytest.raises(ValueError, match="nested more than 100 levels"):
        check_schema_depth(deep)


def test_allowed_tokens_unpacks_llguidance_bitmask() -> None:
    # Word 0 allows tokens 0 and 3, word 1 allows token 32 + 1; the vocab ends at 40.
    words = [1 | 1 << 3, 1 << 1]
    mask = allowed_tokens(b"".join(w.to_bytes(4, "little") for w in words), 40)
    assert mask.dtype == torch.bool and mask.shape == (40,)
    assert mask.nonzero().flatten().tolist() == [0, 3, 33]


def test_ebnf_in_lark_or_gbnf_and_its_errors() -> None:
    assert grammar_of(None, None, 'start: "yes" | "no"')
    assert "start" in grammar_of(None, None, 'root ::= "yes" | "no"')  # GBNF (SGLang, vLLM) becomes Lark
    with pytest.raises(ValueError, match=r"^ebnf: .*unknown name"):
        grammar_of(None, None, "start: nope")
    with pytest.raises(ValueError, match=r"^ebnf: No 'root' rule found"):
        grammar_of(None, None, "")
    with pytest.raises(ValueError, match="give at most one of json_schema, regex and ebnf"):
        grammar_of(None, "a", "start: \"a\"")


def test_choice_regex_matches_exactly_the_choices() -> None:
    import re

    choices = ["a b", "x.y", "(c)|d", "ü*"]
    pattern = choice_regex(choices)
    assert grammar_of(None, pattern)
    assert all(re.fullmatch(pattern, c) for c in choices)
    assert not any(re.fullmatch(pattern, c) for c in ["a", "xzy", "c", "d", "ü"])


def test_whitespace_pattern_makes_json_whitespace_flexible() -> None:
    assert '"whitespace_pattern": "[ ]?"' in json.dumps(json.loads(grammar_of('{"type": "object"}', None,
                                                                               whitespace_pattern="[ ]?")))
