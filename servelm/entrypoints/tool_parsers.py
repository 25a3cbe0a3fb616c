"""Tool-call parsers (`--tool-call-parser NAME`): each model family's own way of writing calls, read back as
OpenAI tool calls, whole or streamed (id and name first, then the arguments' JSON text piece by piece).

* `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (servelm.entrypoints.tool_calls keeps its scanner);
* `llama3_json` (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}` as the whole output, maybe after
  `<|python_tag|>`, several joined by `;`;
* `mistral` (Mistral, Mixtral, Ministral): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or with v11+
  tokenizers `[TOOL_CALLS]name[ARGS]{...}` per call;
* `pythonic` (Llama 3.2 / 4 with pythonic templates, ToolACE): `[get_weather(city="Paris"), get_time()]` as the
  whole output;
* `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>`
  `</tool_call>`;
* `openai` (gpt-oss): harmony messages to `functions.NAME`, read with the openai-harmony package
  (servelm.entrypoints.harmony).

`auto` picks one from the chat template's own markers (`pick_parser`). Plugins: an entry point in the group
`servelm.tool_parsers` naming a `ToolParser` subclass adds a parser by its name.

A parser (other than hermes, which keeps its own scanner) implements one method, `scan(text, final)`: the
content that can go out and the calls written so far, each with the part of its arguments' JSON text that can
no longer change. `CallStream` turns successive scans into deltas, so a parser is written once for both the
whole and the streamed reply. Arguments the model writes as JSON (llama3_json, mistral) stream as written;
those written otherwise (pythonic, qwen3_coder XML) as the JSON of their complete parameters, `{"a": 1, "b"...`
growing as each parameter ends, `}` when the call does.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from servelm.entrypoints.openai_protocol import (
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from servelm.entrypoints.tool_calls import held_prefix
from servelm.plugins import with_plugins

ENTRY_POINT_GROUP = "servelm.tool_parsers"


@dataclass
class PartialCall:
    """One call as far as it is written."""

    name: str | None = None  # once complete
    args: str = ""  # the arguments' JSON text that is final so far (a prefix of the whole)
    done: bool = False  # complete: `args` is the whole JSON text


@dataclass
class Scan:
    content: str  # text that is not a call; while streaming, only what can go out now
    calls: list[PartialCall] = field(default_factory=list)


def args_prefix(pairs: Sequence[tuple[str, Any]], done: bool) -> str:
    """The JSON object of `pairs` without its closing brace until `done`: each complete parameter only ever
    extends the text, so it streams as a prefix."""
    body = ", ".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
    return "{" + body + ("}" if done else "")


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array opening at `start` (strings and escapes respected), or None
    while it is still open."""
    depth, in_string, escape = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class JsonCallScanner:
    """The calls in JSON text as it grows: objects `{"name": ..., "<args key>": {...}}` at `depth` (1: objects
    one after another, 2: in a list); each call's arguments stream as their raw JSON text."""

    def __init__(self, depth: int, args_keys: tuple[str, ...]) -> None:
        from servelm.entrypoints.tool_calls import ConstrainedCallStream

        self._scan = ConstrainedCallStream(None, call_depth=depth, args_keys=args_keys)

    def calls(self, text: str) -> list[PartialCall]:
        scan = self._scan
        if len(text) > len(scan.text):
            scan.text = text
            scan._scan()
        out = []
        for c in scan.calls:
            end = c.args_end
            args = "" if c.args_start is None else text[c.args_start:end if end is not None else len(text)]
            out.append(PartialCall(c.name, args if end is not None else _json_stable(args), end is not None))
        return out


def _json_stable(partial: str) -> str:
    """Of raw JSON arguments being written, the part that will stay: all but a trailing run of whitespace."""
    return partial.rstrip()


class ToolParser:
    """One model family's tool-call format. Subclasses set `name` and implement `scan`."""

    name: ClassVar[str] = ""

    def __init__(self, tools: Sequence[ChatTool] | None = None) -> None:
        self.tools = {t.function.name: t for t in tools or []}

    def scan(self, text: str, final: bool) -> Scan:  # pragma: no cover - interface
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; a call that is not complete and well formed is dropped, and
        with no call the whole text is the content."""
        scan = self.scan(text, final=True)
        calls = self.calls_of(scan)
        if not calls:
            return text or None, []
        return scan.content.strip() or None, calls

    @staticmethod
    def calls_of(scan: Scan) -> list[ToolCall]:
        """The complete, well-formed calls of a finished scan."""
        calls = []
        for c in scan.calls:
            if not (c.done and c.name):
                continue
            try:
                json.loads(c.args or "{}")
            except json.JSONDecodeError:
                continue
            calls.append(ToolCall(id=random_id("call"), function=FunctionCall(name=c.name, arguments=c.args or "{}")))
        return calls

    def stream(self) -> CallStream:
        return CallStream(self)

    def param_type(self, function: str | None, key: str) -> str | None:
        """The JSON schema type of a tool's parameter, when the request's tools say."""
        tool = self.tools.get(function or "")
        params = (tool.function.parameters or {}) if tool is not None else {}
        prop = (params.get("properties") or {}).get(key) or {}
        kind = prop.get("type")
        return kind if isinstance(kind, str) else None


class CallStream:
    """Deltas of one streamed output from its parser's successive scans (the interface of HermesStream)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of the scan's content sent
        self._args_sent: list[int] = []
        self._ids: list[str] = []

    def feed(self, delta: str) -> str:
        """Add new output; return the content that can go out now."""
        self.text += delta
        self._scan = self.parser.scan(self.text, final=False)
        content = self._scan.content
        out, self.sent = content[self.sent:], max(self.sent, len(content))
        return out

    def call_deltas(self) -> list[DeltaToolCall]:
        out = []
        for k, call in enumerate(self._scan.calls):
            if call.name is None:
                break  # calls start in order
            if k == len(self._ids):
                self._ids.append(random_id("call"))
                self._args_sent.append(0)
                out.append(DeltaToolCall(index=k, id=self._ids[k], type="function",
                                         function=DeltaFunctionCall(name=call.name, arguments="")))
            if len(call.args) > self._args_sent[k]:
                out.append(DeltaToolCall(index=k, function=DeltaFunctionCall(arguments=call.args[self._args_sent[k]:])))
                self._args_sent[k] = len(call.args)
        return out

    @property
    def streamed_calls(self) -> int:
        return len(self._ids)

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """At the end: (the content not sent yet, the calls)."""
        content, calls = self.parser.parse(self.text)
        return (content or "")[self.sent:] or None, calls


# ---------------------------------------------------------------------------------------------- llama3_json
class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3's JSON calls: the output is `{"name": ..., "parameters": {...}}` (`arguments` accepted),
    maybe after `<|python_tag|>`, several joined by `;`. Anything else is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def __init__(self, tools: Sequence[ChatTool] | None = None) -> None:
        super().__init__(tools)
        self._json = JsonCallScanner(1, ("parameters", "arguments"))

    def scan(self, text: str, final: bool) -> Scan:
        head = text.lstrip()
        body = head[len(self.TAG):].lstrip() if head.startswith(self.TAG) else head
        if body.startswith("{"):
            offset = len(text) - len(body)
            return Scan("", self._json.calls(text[offset:]) if not final else _json_objects(body))
        if not final and self.TAG.startswith(head):  # nothing yet, or the tag being written
            return Scan("")
        if not final and head.startswith(self.TAG):
            return Scan("")  # the tag, then whitespace: a call follows
        return Scan(text)


def _json_objects(body: str) -> list[PartialCall]:
    """The `{name, parameters|arguments}` objects of a finished llama3_json output, `;`-separated."""
    calls, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
        if i >= len(body):
            break
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            calls.append(PartialCall(None))
            break
        if not isinstance(obj, dict) or "name" not in obj:
            calls.append(PartialCall(None))
            break
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append(PartialCall(str(obj["name"]), args if isinstance(args, str) else json.dumps(args), True))
    return calls


# ---------------------------------------------------------------------------------------------- mistral
class MistralParser(ToolParser):
    """Mistral's `[TOOL_CALLS]`: a JSON list of `{"name", "arguments"}` after it, or (v11+ tokenizers) the
    function's name, `[ARGS]` and its JSON arguments, the marker again before each further call. Text before
    the first marker is content."""

    name = "mistral"
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, tools: Sequence[ChatTool] | None = None) -> None:
        super().__init__(tools)
        self._json = JsonCallScanner(2, ("arguments",))

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(self.MARK)
        if at < 0:
            keep = len(text) if final else len(text) - held_prefix(text, self.MARK)
            return Scan(text[:keep])
        content, rest = text[:at], text[at + len(self.MARK):]
        if rest.lstrip().startswith("["):  # the list form
            offset = at + len(self.MARK) + len(rest) - len(rest.lstrip())
            return Scan(content, self._json.calls(text[offset:]))
        if not rest.strip() and not final:
            return Scan(content)
        calls = []
        for part in rest.split(self.MARK):
            name, sep, args = part.partition(self.ARGS)
            if not sep:  # the name is still being written (or no [ARGS] came)
                calls.append(PartialCall(None))
                break
            args = args.lstrip()
            end = json_end(args, 0) if args.startswith("{") else None
            calls.append(PartialCall(name.strip(), args[:end] if end is not None else _json_stable(args),
                                     end is not None))
            if end is None:
                break
        return Scan(content, calls)


# ---------------------------------------------------------------------------------------------- pythonic
class PythonicParser(ToolParser):
    """Python call syntax: the output is a list `[f(a=1, b="x"), g()]` (maybe inside Llama 4's
    `<|python_start|>` ... `<|python_end|>`). Each keyword's value is a Python literal; a parameter goes out
    once the comma or parenthesis after it is written."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def scan(self, text: str, final: bool) -> Scan:
        head = text.lstrip()
        if head.startswith(self.START):
            head = head[len(self.START):].lstrip()
        if head.endswith(self.END):
            head = head[:-len(self.END)].rstrip()
        if not head.startswith("["):
            if not final and (not head or self.START.startswith(head)):
                return Scan("")
            return Scan(text)
        return Scan("", _python_calls(head, final))


def _scan_python(text: str, sep: str = ",") -> tuple[list[str], int | None]:
    """`text` (just inside an opening bracket) split at `sep` outside brackets and strings, up to the bracket
    that closes it: (the parts, the index of that bracket, None while it is still open)."""
    parts, depth, quote, escape, start = [], 0, "", False, 0
    for i, c in enumerate(text):
        if quote:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                parts.append(text[start:i])
                return parts, i
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts, None


def _python_calls(head: str, final: bool) -> list[PartialCall]:
    items, _ = _scan_python(head[1:])
    calls = []
    for item in items:
        item = item.lstrip()
        if not item.strip():
            continue
        name, paren, body = item.partition("(")
        if not paren or not name.strip().replace(".", "_").isidentifier():
            calls.append(PartialCall(None))
            break
        kwargs, close = _scan_python(body)
        done = close is not None
        pairs = []
        for k, kw in enumerate(kwargs):
            if not (done or k < len(kwargs) - 1) or not kw.strip():
                continue  # the last parameter of an open call may still grow
            key, eq, value = kw.partition("=")
            try:
                if not eq or not key.strip().isidentifier():
                    raise ValueError(kw)
                pairs.append((key.strip(), ast.literal_eval(value.strip())))
            except (ValueError, SyntaxError):
                return [*calls, PartialCall(name.strip())]  # not a call this parser can read
        calls.append(PartialCall(name.strip(), args_prefix(pairs, done), done))
        if not done:
            break
    return calls


# ---------------------------------------------------------------------------------------------- qwen3_coder
class Qwen3CoderParser(ToolParser):
    """Qwen3-Coder's XML calls: `<tool_call>` `<function=NAME>` then `<parameter=KEY>` value `</parameter>`
    per argument, `</function>` `</tool_call>`. A value is taken as the tool's schema says (a string for a
    string parameter, else JSON, else a Python literal, else the text). Text before the first call is content."""

    name = "qwen3_coder"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FN, FN_END, P, P_END = "<function=", "</function>", "<parameter=", "</parameter>"

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(self.OPEN)
        if at < 0:
            at = text.find(self.FN)  # some outputs drop the outer tag
        if at < 0:
            keep = len(text) if final else len(text) - max(held_prefix(text, self.OPEN), held_prefix(text, self.FN))
            return Scan(text[:keep])
        calls, pos = [], at
        while True:
            fn = text.find(self.FN, pos)
            if fn < 0:
                break
            gt = text.find(">", fn)
            if gt < 0:
                calls.append(PartialCall(None))
                break
            name = text[fn + len(self.FN):gt].strip()
            end = text.find(self.FN_END, gt)
            body = text[gt + 1:end if end >= 0 else len(text)]
            pairs = []
            p = 0
            while True:
                s = body.find(self.P, p)
                if s < 0:
                    break
                g = body.find(">", s)
                e = body.find(self.P_END, g) if g >= 0 else -1
                if g < 0 or e < 0:
                    break  # this parameter is still being written
                key = body[s + len(self.P):g].strip()
                pairs.append((key, self._value(name, key, body[g + 1:e])))
                p = e + len(self.P_END)
            done = end >= 0
            calls.append(PartialCall(name, args_prefix(pairs, done), done))
            if not done:
                break
            pos = end + len(self.FN_END)
        content = text[:at]
        return Scan(content + (self._after(text, pos) if final and calls and calls[-1].done else ""), calls)

    def _after(self, text: str, pos: int) -> str:
        rest = text[pos:]
        while True:
            stripped = rest.lstrip()
            if stripped.startswith(self.CLOSE):
                rest = stripped[len(self.CLOSE):]
            else:
                return rest if stripped.strip() and self.FN not in stripped else ""

    def _value(self, function: str, key: str, raw: str) -> Any:
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        kind = self.param_type(function, key)
        if kind == "string":
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value


# ---------------------------------------------------------------------------------------------- openai (harmony)
class HarmonyToolParser(ToolParser):
    """gpt-oss's harmony messages (servelm.entrypoints.harmony reads them with openai-harmony): a message to
    `functions.NAME` is a call with the message as its JSON arguments; the content is the final and preamble
    messages' text, never the analysis (the reasoning parser's)."""

    name = "openai"

    def __init__(self, tools: Sequence[ChatTool] | None = None) -> None:
        super().__init__(tools)
        self._reader: Any = None  # the HarmonyReader of the text scanned last

    def scan(self, text: str, final: bool) -> Scan:
        from servelm.entrypoints import harmony

        reader = self._reader
        if reader is None or not text.startswith(reader.text) or (reader.finished and text != reader.text):
            reader = self._reader = harmony.HarmonyReader(harmony.encoding())
        read = reader.feed(text[len(reader.text):])
        if final:
            read = reader.finish()
        return Scan(read.content, [PartialCall(c.name, c.args if c.done else _json_stable(c.args), c.done)
                                   for c in read.calls])

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        scan = self.scan(text, final=True)
        return scan.content.strip() or None, self.calls_of(scan)

    def stream(self) -> CallStream:
        fresh = type(self)()  # a reader of its own per streamed choice
        fresh.tools = self.tools
        return CallStream(fresh)


# ---------------------------------------------------------------------------------------------- the registry
class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` (servelm.entrypoints.tool_calls keeps its scanner)."""

    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        from servelm.entrypoints.tool_calls import parse_hermes

        return parse_hermes(text)

    def stream(self) -> Any:
        from servelm.entrypoints.tool_calls import HermesStream

        return HermesStream()


BUILTIN: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser, PythonicParser, Qwen3CoderParser, HarmonyToolParser)}


def parsers() -> dict[str, type[ToolParser]]:
    """The built-in parsers and those of installed plugins (a plugin's name may not shadow a built-in)."""
    return with_plugins(ENTRY_POINT_GROUP, BUILTIN,
                        lambda cls: cls if isinstance(cls, type) and issubclass(cls, ToolParser) else None,
                        "tool parser (a ToolParser subclass)")


def pick_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own markers imply (`--tool-call-parser auto`), or None."""
    t = chat_template or ""
    if "<|call|>" in t or "to=functions." in t:
        return "openai"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_start|>" in t or "[func_name1(" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return "llama3_json"
    return None


def resolve(name: str | None, chat_template: str | None) -> str | None:
    """The parser name `--tool-call-parser NAME` stands for (auto: from the template, None when it shows no
    known format); ValueError with the choices for an unknown name."""
    if name is None:
        return None
    if name == "auto":
        return pick_parser(chat_template)
    known = parsers()
    if name not in known:
        raise ValueError(f"--tool-call-parser {name!r} is not known; choose one of: auto, {', '.join(known)}")
    return name


def make_parser(name: str, tools: Sequence[ChatTool] | None) -> ToolParser:
    return parsers()[name](tools)
