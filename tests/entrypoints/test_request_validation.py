"""Request validation helpers, without a server: text validity, schema depth, the API-key guard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from servelm.constrained import MAX_SCHEMA_DEPTH, check_schema_depth, grammar_of
from servelm.entrypoints.http_common import guard_error
from servelm.entrypoints.openai_protocol import CompletionRequest, invalid_text_path

LONE = "\ud800"


def test_invalid_text_path_finds_lone_surrogates_anywhere() -> None:
    assert invalid_text_path({"prompt": "ok", "stop": ["a", "b"], "n": 1, "x": None}) is None
    assert invalid_text_path({"prompt": LONE}) == "prompt"
    assert invalid_text_path({"messages": [{"role": "user", "content": "a"}, {"content": f"x{LONE}"}]}) == \
        "messages.1.content"
    assert invalid_text_path({"tools": {f"k{LONE}": 1}}) == "tools.k?"  # a bad key, printed safely
    assert invalid_text_path(LONE) == "body"
    deep: object = LONE
    for _ in range(5000):  # far deeper than Python's recursion limit
        deep = [deep]
    assert invalid_text_path({"a": deep}) == "a" + ".0" * 5000


def test_request_models_refuse_invalid_text() -> None:
    with pytest.raises(ValueError, match=r"prompt: not valid Unicode text"):
        CompletionRequest.model_validate({"prompt": LONE})
    assert CompletionRequest.model_validate({"prompt": "h\u00e9llo \U0001f600"}).prompt == "h\u00e9llo \U0001f600"


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


def test_schema_depth_is_bounded() -> None:
    check_schema_depth(nested(MAX_SCHEMA_DEPTH))
    with pytest.raises(ValueError, match=f"response_format: nested more than {MAX_SCHEMA_DEPTH} levels deep"):
        check_schema_depth(nested(MAX_SCHEMA_DEPTH + 1), "response_format")
    # A schema text too deep for json.loads itself is the same ValueError, never a RecursionError.
    text = '{"items": ' * 5000 + "{}" + "}" * 5000
    with pytest.raises(ValueError, match="json_schema: nested more than"):
        grammar_of(text, None)


def guard(api_key: str | None, header: bytes | None) -> int | None:
    state = SimpleNamespace(api_key=api_key, shutting_down=False, ready=True)
    scope = {"headers": [] if header is None else [(b"authorization", header)]}
    response = guard_error(state, scope)  # type: ignore[arg-type]
    return None if response is None else response.status_code


def test_api_key_compares_bytes_so_non_ascii_keys_work() -> None:
    key = "cl\u00e9-\u043a\u043b\u044e\u0447"
    assert guard(key, b"Bearer " + key.encode("utf-8")) is None
    assert guard(key, b"bearer " + key.encode("utf-8") + b" ") is None
    assert guard(key, b"Bearer " + key.encode("latin-1", "replace")) == 401
    assert guard(key, None) == 401
    assert guard("sk-secret", b"Bearer sk-secret") is None
    assert guard("sk-secret", b"Bearer sk-secreT") == 401
    assert guard(None, None) is None


def test_one_home_for_prompt_checks() -> None:
    from servelm.sampling_params import context_length_error, token_ids_error

    assert token_ids_error([1, 2], 10) is None
    assert token_ids_error([], 10, "input_ids") == "input_ids must not be empty"
    assert token_ids_error([1, 10], 10) == "prompt: token id 10 at position 1 is out of range [0, 10)"
    assert context_length_error(10, 5, 0) is None  # unknown context length: nothing to check
    assert context_length_error(10, 5, 16) is None
    assert context_length_error(16, None, 16) == (
        "The input (16 tokens) is longer than the model's context length (16 tokens). This model's maximum context "
        "length is 16 tokens. However, the prompt has 16 tokens. Please reduce the length of the prompt.")
    # a KV pool smaller than the model's context: both sizes named, and what makes room
    assert context_length_error(20, None, 16, model_context=8192).endswith(
        "Please reduce the length of the prompt. The KV cache pool holds 16 tokens, fewer than the model's context "
        "length of 8192: a larger pool (--cpu-kv-cache-gb, --mem-fraction-static on a GPU, --max-total-tokens) or a "
        "--kv-cache-dtype of fewer bytes makes room.")
    assert "pool" not in context_length_error(20, None, 16, model_context=16)
    assert context_length_error(10, 7, 16, "messages", "max_completion_tokens") == (
        "Requested token count exceeds the model's maximum context length of 16 tokens. You requested a total of 17 "
        "tokens: 10 tokens from the input messages and 7 tokens for the completion. Please reduce the number of "
        "tokens in the input messages or the completion to fit within the limit. (OpenAI: you requested 17 tokens "
        "(10 in the messages, 7 in the completion). Please reduce the length of the messages or "
        "max_completion_tokens.)")


def test_sampling_params_range_checks_of_issue_15() -> None:
    from servelm.sampling_params import SamplingParams, SamplingParamsError, top_logprobs_error

    SamplingParams(seed=2**63 - 1).validate(10)
    SamplingParams(seed=-(2**63)).validate(10)
    with pytest.raises(SamplingParamsError, match=r"seed must be in \[-2\^63, 2\^63 - 1\], got 9223372036854775808"):
        SamplingParams(seed=2**63).validate(10)
    assert top_logprobs_error(-1) == ("top_logprobs -1 (the whole vocabulary) needs the server started with "
                                      "--max-logprobs -1; this one allows at most 20")
    assert top_logprobs_error(21) == "top_logprobs must be in [0, 20], got 21"
    assert top_logprobs_error(-1, limit=-1) is None and top_logprobs_error(500, limit=-1) is None
    assert top_logprobs_error(None) is None and top_logprobs_error(20) is None
    with pytest.raises(SamplingParamsError) as exc:  # every bad key named, not only the first
        SamplingParams(logit_bias={"1": 0, "x": 1, "10": 1, "-2": 1}).validate(10)
    assert exc.value.param == "logit_bias" and str(exc.value).endswith("got 'x', 10, -2")
    with pytest.raises(SamplingParamsError, match="stop_regex: not a valid regular expression"):
        SamplingParams(stop_regex="(a").validate(10)
    SamplingParams(stop_regex=["a"] * 16).validate(10)
    for patterns in (["a"] * 17, ["a" * 1025]):  # searched after every token in the scheduler loop: bounded
        with pytest.raises(SamplingParamsError, match="at most 16 patterns of at most 1024 characters"):
            SamplingParams(stop_regex=patterns).validate(10)


def test_constraints_of_reads_every_spelling() -> None:
    from servelm.entrypoints.openai_protocol import ChatCompletionRequest
    from servelm.entrypoints.serving_base import constraints_of

    def found(**body: object) -> list[tuple[str, str]]:
        req = ChatCompletionRequest.model_validate({"messages": [], **body})
        return [(kind, name) for kind, _, name in constraints_of(req)]

    assert found() == []
    assert found(guided_choice=["a"], structured_outputs={"json_object": True}) == [
        ("regex", "guided_choice"), ("json_schema", "structured_outputs.json_object")]
    assert found(ebnf="start: x", guided_grammar="g", json_schema={"type": "object"}) == [
        ("json_schema", "json_schema"), ("ebnf", "ebnf"), ("ebnf", "guided_grammar")]
    assert found(response_format={"type": "text"}, structured_outputs={"json_object": False}) == []
