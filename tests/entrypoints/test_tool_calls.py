"""Tool-call planning, the hermes parser, streamed constrained calls and strict schemas, without a model (the
server tests drive them end to end)."""

from __future__ import annotations

import json
import random

import jinja2
import pytest

from servelm.constrained import strict_schema
from servelm.entrypoints.openai_protocol import ChatMessage, ChatTool, NamedToolChoice
from servelm.entrypoints.tool_calls import (
    AUTO_UNSUPPORTED,
    ConstrainedCallStream,
    HermesStream,
    parse_hermes,
    plan_tool_calls,
    template_messages,
)
from servelm.entrypoints.tool_parsers import make_parser

TOOLS = [ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})]
TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.')


def test_plans() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser") as exc:
        plan_tool_calls(TOOLS, None)
    assert str(exc.value) == AUTO_UNSUPPORTED
    with pytest.raises(ValueError, match="needs tools"):
        plan_tool_calls(None, "required")
    with pytest.raises(ValueError, match="'g', which is not in tools"):
        plan_tool_calls(TOOLS, NamedToolChoice.model_validate({"function": {"name": "g"}}))
    assert plan_tool_calls(TOOLS, "none") is None and plan_tool_calls(None, None) is None
    auto = plan_tool_calls(TOOLS, "auto", make_parser("hermes", TOOLS))
    assert auto is not None and auto.auto and auto.json_schema() is None
    named = plan_tool_calls(TOOLS, NamedToolChoice.model_validate({"function": {"name": "f"}}))
    assert named is not None and named.read('{"a": 1}')[1][0].function.arguments == '{"a": 1}'
    required = plan_tool_calls(TOOLS, "required")
    assert required is not None and json.loads(required.json_schema())["minItems"] == 1
    content, calls = required.read('[{"name": "f", "parameters": {"x": [1, 2]}}]')
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("f", {"x": [1, 2]})]
    assert required.read('[{"name": "f", "param') == ('[{"name": "f", "param', [])  # cut off: kept as text
    single = plan_tool_calls(TOOLS, "required", parallel=False)
    assert single is not None and json.loads(single.json_schema())["maxItems"] == 1


def test_parse_hermes() -> None:
    content, calls = parse_hermes(TEXT)
    assert content == "Let me check.  Done."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    assert parse_hermes("just text") == ("just text", [])
    bad = 'x <tool_call>{"oops": 1}</tool_call>'  # not a call: left in the content as written
    assert parse_hermes(bad) == (bad, [])
    content, calls = parse_hermes('<tool_call>{"name": "f", "arguments": {"a": 1}}')  # cut before the close
    assert content is None and calls[0].function.arguments == '{"a": 1}'


@pytest.mark.parametrize("seed", range(5))
def test_hermes_stream_never_leaks_a_call(seed: int) -> None:
    """Fed in random pieces, the streamed content is exactly the text before the first call."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 12))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
    stream = HermesStream()
    sent = "".join(stream.feed(p) for p in pieces)
    assert sent == "Let me check. "
    rest, calls = stream.finish()
    assert rest == "Done." and [c.function.name for c in calls] == ["get_weather", "get_time"]
    plain = HermesStream()
    assert "".join(plain.feed(p) for p in ["a <tool", "_c", "x> b"]) == "a <tool_cx> b"
    assert plain.finish() == (None, [])


def test_tool_history_reaches_templates_as_objects() -> None:
    """A Qwen/Hermes-style template writes `arguments | tojson`: it must print the arguments once, not a
    JSON string of JSON."""
    template = jinja2.Environment().from_string(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}<tool_call>"
        "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
        "{% endfor %}{% endfor %}")
    history = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"})]
    messages = template_messages(history)
    assert messages[2] == {"role": "tool", "content": "21C", "tool_call_id": "c1"}
    rendered = template.render(messages=messages)
    assert rendered == '<tool_call>{"arguments": {"city": "Paris"}, "name": "w"}</tool_call>'  # tojson sorts keys
    assert [c.function.arguments for c in parse_hermes(rendered)[1]] == ['{"city": "Paris"}']  # round trip
    bad = history[:1] + [ChatMessage.model_validate({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "w", "arguments": "{oops"}}]})]
    with pytest.raises(ValueError, match="not valid JSON"):
        template_messages(bad)


# ------------------------------------------------------------ streaming constrained calls
def stream_all(scan: ConstrainedCallStream, text: str, step: int) -> list[tuple[int, str | None, str]]:
    """(index, name, arguments) per call, from the deltas of `text` fed `step` characters at a time."""
    calls: dict[int, list] = {}
    for i in range(0, len(text), step):
        for d in scan.feed(text[i:i + step]):
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    return [(k, name, args) for k, (name, args) in calls.items()]


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_required_list_streams_each_call_by_index(step: int) -> None:
    args0 = '{"city": "Pa\\"ris}", "n": {"x": [1, 2]}}'
    text = f'[{{"name": "get_weather", "parameters": {args0}}}, {{"name": "t", "parameters": {{}}}}]'
    assert stream_all(ConstrainedCallStream(None), text, step) == [(0, "get_weather", args0), (1, "t", "{}")]


def test_required_list_cut_off_streams_what_is_there() -> None:
    scan = ConstrainedCallStream(None)
    assert stream_all(scan, '[{"name": "get_wea', 3) == []  # no name yet: nothing to send
    assert stream_all(scan, 'ther", "parameters": {"ci', 4) == [(0, "get_weather", '{"ci')]


def test_named_call_streams_its_arguments_as_written() -> None:
    assert stream_all(ConstrainedCallStream("f"), '{"a": 1}', 3) == [(0, "f", '{"a": 1}')]


def test_strict_schema_closes_declared_objects_only() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "list": {"type": "array", "items": {"properties": {"x": {}}}},
        "open": {"properties": {"y": {}}, "additionalProperties": True},
        "free": {"type": "object"}},
        "$defs": {"D": {"properties": {"q": {}}}},
        "allOf": [{"properties": {"a": {}}}, {"properties": {"k": {"properties": {"z": {}}}}}]}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False and props["list"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and "additionalProperties" not in props["free"]
    assert out["$defs"]["D"]["additionalProperties"] is False
    # allOf branches each name part of the object: they stay open, what they nest does not.
    assert "additionalProperties" not in out["allOf"][0]
    assert out["allOf"][1]["properties"]["k"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left as it was


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_stream_as_they_are_written(step: int) -> None:
    text = TEXT.replace('{"name": "get_time", "arguments": {}}', '{"arguments": {}, "name": "get_time"}')
    stream = HermesStream()
    content, deltas = "", []
    for i in range(0, len(text), step):
        content += stream.feed(text[i:i + step])
        deltas += stream.call_deltas()
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = [d.function.name, ""]
        calls[d.index][1] += d.function.arguments or ""
    assert content == "Let me check. "
    assert calls == {0: ["get_weather", '{"city": "Paris"}'], 1: ["get_time", "{}"]}
    assert stream.streamed_calls == 2 and stream.finish()[0] == "Done."
