"""Bad input never gives a 5xx: hand-picked hostile bodies, then hypothesis over request bodies, against
a real server on a tiny random Llama; afterwards it still serves, with no KV page in use."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_fixtures import ServerProcess, start_server

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/generate", "/v1/tokenize", "/v1/detokenize",
             "/abort_request"]
LONE = "\ud800"  # a lone UTF-16 surrogate: valid in a JSON escape, not valid Unicode text


@pytest.fixture(scope="module")
def server(tiny_llama: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    srv = start_server(["--model-path", str(tiny_llama[0]), "--disable-torch-compile", "--max-total-tokens", "8192",
                        "--served-model-name", "tiny"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "Traceback" not in srv.log()


def post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    # ensure_ascii: a lone surrogate travels as the JSON escape "\ud800", as a client would send it.
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body, ensure_ascii=True).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def assert_healthy(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    deadline = time.monotonic() + 30
    while True:
        info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
        if info["num_in_flight"] == 0 and info["kv_in_use_tokens"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert info["kv_integrity_ok"] is True


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_schema_text(depth: int) -> str:
    """The same as JSON text, built as text (json.dumps itself runs out of recursion at this depth)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


HOSTILE = [
    ("/v1/completions", {"prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "x" + LONE], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": LONE, "prompt": "hi", "max_tokens": 2}, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "rid": LONE}, "rid"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [LONE]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                  "type": "object", "properties": {LONE: {"type": "string"}}}}}}, "response_format"),
    ("/generate", {"text": LONE, "sampling_params": {"max_new_tokens": 2}}, "text"),
    ("/generate", {"text": "hi", "rid": LONE, "sampling_params": {"max_new_tokens": 2}}, "rid"),
    ("/v1/tokenize", {"prompt": LONE}, "prompt"),
    ("/v1/tokenize", {"model": LONE, "prompt": "hi"}, "model"),
    ("/abort_request", {"rid": LONE}, "rid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "deep", "schema": nested_schema(150)}}},
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "tools": [{"type": "function", "function": {"name": "f",
                                                                          "parameters": nested_schema(150)}}],
                              "tool_choice": "required"}, "tools"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2,
                                                     "json_schema": nested_schema_text(150)}},
     "sampling_params.json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2,
                                                     "json_schema": nested_schema_text(1000)}},
     "sampling_params.json_schema"),
]


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE, ids=[f"{p}-{b.get('model', '')!r}-{i}"
                                                                   for i, (p, b, _) in enumerate(HOSTILE)])
def test_hostile_text_and_nesting_are_400s(server: ServerProcess, path: str, body: dict, param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_deep_json_body_is_a_400(server: ServerProcess) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    r = httpx.post(f"{server.base_url}/v1/completions", content=f'{{"prompt": {deep}}}'.encode(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert_healthy(server)


# ------------------------------------------------------------- hypothesis
# Text that includes lone surrogates (category Cs), controls and other odd code points.
texts = st.one_of(st.just(LONE), st.text(st.characters(categories=["Cs", "Cc", "Lu", "Ll", "Nd", "Zs", "So", "Mn"]),
                                         max_size=8))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), texts,
                    st.sampled_from(["tiny", "user", "json_object", "json_schema", "function", "required", "auto"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
# A valid request per endpoint: the fuzzer replaces some of its fields (or the whole body).
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/tokenize": {"prompt": "hi"},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/abort_request": {"rid": "x"},
}
FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
                        "logprobs", "echo", "response_format", "logit_bias", "rid", "regex", "suffix",
                        "stream_options", "stop_token_ids", "min_tokens"],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "logprobs",
                             "top_logprobs", "tools", "tool_choice", "response_format", "rid", "stop", "n",
                             "parallel_tool_calls", "continue_final_message"],
    "/generate": ["text", "input_ids", "sampling_params", "rid"],
    "/v1/tokenize": ["model", "prompt", "messages", "add_special_tokens"],
    "/v1/detokenize": ["model", "tokens"],
    "/abort_request": ["rid"],
}
BOUNDED = ("max_tokens", "max_completion_tokens", "max_new_tokens", "n", "min_tokens")


def bounded(body: Any) -> Any:
    """Keep generation short whatever the fuzzer picked: ints in the length fields are clamped to 4."""
    if isinstance(body, dict):
        return {k: (min(v, 4) if k in BOUNDED and isinstance(v, int) and not isinstance(v, bool) else bounded(v))
                for k, v in body.items()}
    if isinstance(body, list):
        return [bounded(v) for v in body]
    return body


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(ENDPOINTS), replace_all=st.integers(0, 9), data=st.data())
def test_fuzzed_bodies_never_5xx(server: ServerProcess, path: str, replace_all: int, data: st.DataObject) -> None:
    if replace_all == 0:
        body = data.draw(values, label="body")
    else:
        field_values = st.one_of(texts, scalars, values)  # plain text often: most fields are strings
        body = {**BASES[path], **data.draw(st.dictionaries(st.sampled_from(FIELDS[path]), field_values, min_size=1,
                                                           max_size=3), label="fields")}
    r = post(server, path, bounded(body))  # never streamed: a stream's status is sent before any late error
    assert r.status_code < 500, (path, body, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text


def test_still_healthy_after_fuzzing(server: ServerProcess) -> None:
    assert_healthy(server)
