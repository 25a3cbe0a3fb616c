"""The tool-call parsers on the exact text each family's models write (by hand, from the families' documented
formats): whole, and streamed with the output cut at every character (so at every token boundary), where the
content deltas, the call deltas (id and name first, then argument pieces) and the finish add up to the whole
reply. Then auto's choice from chat templates, plugins, and the registry's errors."""

from __future__ import annotations

import json

import pytest

from servelm import plugins
from servelm.config import ConfigError, ServerArgs
from servelm.entrypoints import tool_parsers
from servelm.entrypoints.openai_protocol import ChatTool
from servelm.entrypoints.tool_calls import plan_tool_calls
from servelm.entrypoints.tool_parsers import Scan, ToolParser, make_parser, pick_parser, resolve

TOOLS = [ChatTool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string"}, "zip": {"type": "string"}}}}}),
         ChatTool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}}}})]
PARIS = {"location": "Paris, France", "unit": "celsius"}

# (parser, model output, content, [(name, arguments)])
GOLDEN = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n'
               '</tool_call>', None, [("get_weather", PARIS)]),
    # Llama 3.1-3.3 JSON tool calling (the eom/eot tokens are special: not in the text)
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}', None,
     [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": '
                    '"celsius"}}; {"name": "get_time", "parameters": {}}', None,
     [("get_weather", PARIS), ("get_time", {})]),
    ("llama3_json", '{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ("llama3_json", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    # Mistral: the list form, and v11+ tokenizers' name + [ARGS] per call
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": '
                '"celsius"}}, {"name": "get_time", "arguments": {}}]', None,
     [("get_weather", PARIS), ("get_time", {})]),
    ("mistral", 'Let me look. [TOOL_CALLS]get_weather[ARGS]{"location": "Paris, France", "unit": "celsius"}'
                '[TOOL_CALLS]get_time[ARGS]{}', "Let me look.", [("get_weather", PARIS), ("get_time", {})]),
    ("mistral", "No tools needed [TOOL", "No tools needed [TOOL", []),
    # pythonic: Llama 3.2's template, and Llama 4's python tags
    ("pythonic", "[get_weather(location='Paris, France', unit='celsius'), get_time()]", None,
     [("get_weather", PARIS), ("get_time", {})]),
    ("pythonic", '<|python_start|>[get_weather(location="Paris, France", days=3, unit="celsius")]<|python_end|>',
     None, [("get_weather", {"location": "Paris, France", "days": 3, "unit": "celsius"})]),
    ("pythonic", "[get_weather(location=\"a (b), [c]\", zip=None)]", None,
     [("get_weather", {"location": "a (b), [c]", "zip": None})]),
    ("pythonic", "It is sunny [really].", "It is sunny [really].", []),
    # Qwen3-Coder's XML
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis, France\n"
                    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n"
                    "</tool_call>", "I will check.",
     [("get_weather", {"location": "Paris, France", "days": 3, "zip": "75001"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>", None,
     [("get_weather", {"location": "Paris"}), ("get_time", {})]),
    ("qwen3_coder", "Plain <b>text</b>.", "Plain <b>text</b>.", []),
]


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", GOLDEN)
def test_whole_output(name: str, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = make_parser(name, TOOLS).parse(text)
    assert got_content == content and _calls(got_calls) == calls
    plan = plan_tool_calls(TOOLS, "auto", make_parser(name, TOOLS))
    assert plan is not None and plan.auto and _calls(plan.read(text)[1]) == calls


def _stream(name: str, pieces: list[str]) -> tuple[str, dict[int, str], dict[int, str], list]:
    stream = make_parser(name, TOOLS).stream()
    content, names, args = "", {}, {}
    for piece in pieces:
        content += stream.feed(piece)
        for d in stream.call_deltas():
            if d.id is not None:  # a call's first delta: id, type and name, before any argument
                assert d.index not in names and d.function.name and d.type == "function"
                names[d.index] = d.function.name
            else:
                assert d.index in names and d.function.name is None
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    rest, calls = stream.finish()
    return content + (rest or ""), names, args, calls[stream.streamed_calls:]


@pytest.mark.parametrize("name, text, content, calls", GOLDEN)
def test_streamed_at_every_cut(name: str, text: str, content: str | None, calls: list) -> None:
    for cut in [*range(len(text) + 1), -1]:
        pieces = list(text) if cut == -1 else [text[:cut], text[cut:]]
        got, names, args, late = _stream(name, pieces)
        assert got.strip() == (content or ""), (cut, got)
        streamed = [(names[k], json.loads(args[k])) for k in sorted(names)]
        assert streamed + _calls(late) == calls, (cut, streamed)


def test_content_streams_before_the_call_and_holds_back_only_a_marker_prefix() -> None:
    stream = make_parser("mistral", TOOLS).stream()
    assert stream.feed("Sure, [TOOL") == "Sure, "
    assert stream.feed("_CALLS]get_weather") == "" and stream.call_deltas() == []  # the name may still grow
    stream.feed("[ARGS]{\"location\": \"Pa")
    first = stream.call_deltas()
    assert first[0].function.name == "get_weather" and first[1].function.arguments == '{"location": "Pa'
    stream = make_parser("pythonic", TOOLS).stream()
    stream.feed('[get_weather(location="Paris", da')
    deltas = stream.call_deltas()  # a parameter goes out once the comma after it is written
    assert [d.function.arguments for d in deltas] == ["", '{"location": "Paris"']


def test_a_cut_off_or_malformed_call_stays_content() -> None:
    for name, text in [("llama3_json", '{"name": "get_weather", "parameters": {"loc'),
                       ("pythonic", "[get_weather(location=Paris)]"),
                       ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=location>\nPar"),
                       ("mistral", "[TOOL_CALLS]get_weather[ARGS]{\"location\": ")]:
        assert make_parser(name, TOOLS).parse(text) == (text, [])


def test_auto_picks_the_parser_from_the_chat_template() -> None:
    assert pick_parser("{{- '<tool_call>\\n<function=' + name }}<parameter=") == "qwen3_coder"
    assert pick_parser("{{- '<tool_call>\\n' + tool | tojson }}") == "hermes"
    assert pick_parser("{{- '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert pick_parser("[func_name1(params_name1=params_value1, params_name2=params_value2...)]") == "pythonic"
    assert pick_parser('<|start_header_id|>user ... {"name": function name, "parameters": ...}') == "llama3_json"
    assert pick_parser("{{ messages }}") is None and resolve("auto", None) is None
    assert resolve("mistral", None) == "mistral" and resolve(None, "<tool_call>") is None
    with pytest.raises(ValueError, match="choose one of: auto, hermes, llama3_json, mistral, pythonic, qwen3_coder"):
        resolve("nope", None)
    with pytest.raises(ConfigError, match="--tool-call-parser 'nope' is not known"):
        ServerArgs(model_path="m", tool_call_parser="nope")


def test_a_plugin_adds_a_parser_by_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    class Bracket(ToolParser):
        """`<<name {json}>>` calls."""

        def scan(self, text: str, final: bool) -> Scan:
            at = text.find("<<")
            if at < 0:
                return Scan(text)
            name, _, args = text[at + 2:].partition(" ")
            done = args.endswith(">>")
            return Scan(text[:at], [tool_parsers.PartialCall(name or None, args[:-2] if done else "", done)])

    class EntryPoint:
        def __init__(self, name: str, obj: object) -> None:
            self.name, self.value, self._obj = name, f"plugin:{name}", obj

        def load(self) -> object:
            return self._obj

    eps = [EntryPoint("bracket", Bracket), EntryPoint("hermes", Bracket), EntryPoint("junk", object())]
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: eps)
    known = tool_parsers.parsers()
    assert known["bracket"] is Bracket and known["hermes"] is tool_parsers.HermesParser and "junk" not in known
    assert _calls(make_parser("bracket", TOOLS).parse('hi <<get_time {}>>')[1]) == [("get_time", {})]
    assert ServerArgs(model_path="m", tool_call_parser="bracket").tool_call_parser == "bracket"
