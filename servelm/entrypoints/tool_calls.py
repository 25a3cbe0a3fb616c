"""OpenAI tool calls (`tools` + `tool_choice`), as vLLM does them.

A named function or `tool_choice="required"` turns into a JSON schema that the
output must follow (servelm.constrained), so the call is well formed whatever
the model; the text is then read back as tool calls. `"auto"` lets the model
choose, so its output is read with a parser for the model family's own format
(`--tool-call-parser`: hermes here, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
as Qwen2/Qwen3 and Hermes models write it; the others in servelm.entrypoints.tool_parsers);
without a parser it is refused with a message that says what to use instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from servelm.entrypoints.openai_protocol import (
    ChatMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    random_id,
)

AUTO_UNSUPPORTED = ("tool_choice 'auto' (the default when tools are given) needs the server started with "
                    "--tool-call-parser for the model's tool-call format; or pass tool_choice 'required', a named "
                    "function ({\"type\": \"function\", \"function\": {\"name\": ...}}) or 'none'")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`: what a stream holds back
    because the next delta may complete the marker (the tool parsers' and the reasoning splitter's too)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output in the hermes format; a block that is not a JSON call with a
    name (cut off, or malformed) stays in the content as it was written."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for m in _HERMES_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(ToolCall(id=random_id("call"), function=FunctionCall(
            name=str(name), arguments=args if isinstance(args, str) else json.dumps(args))))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else (text or None), calls


@dataclass
class _CallScan:
    """Where one call of a "required" list stands in the text."""

    name: str | None = None
    args_start: int | None = None  # index of the `{` that opens its parameters
    args_end: int | None = None  # index just past the matching `}`
    args_sent: int = 0  # index up to which its arguments were streamed
    started: bool = False  # its first delta (id, name) was sent


@dataclass
class ConstrainedCallStream:
    """Streams the calls of a constrained output as they are written (as vLLM streams them): a named
    function's output is its arguments, so every delta goes out as more arguments; a "required" list
    (`[{"name": ..., "parameters": {...}}, ...]`) is scanned character by character, and each call starts
    once its name is complete, then its parameters' text follows as it grows."""

    named: str | None
    call_depth: int = 2  # JSON depth of a call object: 2 in a list; 1 for one object alone (a hermes block)
    args_keys: tuple[str, ...] = ("parameters",)  # the key whose object holds a call's arguments
    index_base: int = 0  # the index of this stream's first call among the output's calls
    text: str = ""
    calls: list[_CallScan] = field(default_factory=list)
    _pos: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _string_start: int = 0
    _key: str | None = None
    _expect_value: bool = False

    def feed(self, delta: str) -> list[DeltaToolCall]:
        """Add new output; return the deltas that can be sent now."""
        if self.named is not None:
            out = []
            if not self.calls:
                self.calls.append(_CallScan(name=self.named, started=True))
                out.append(DeltaToolCall(index=0, id=random_id("call"), type="function",
                                         function=DeltaFunctionCall(name=self.named, arguments="")))
            if delta:
                out.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta)))
            return out
        self.text += delta
        self._scan()
        return self._deltas()

    def _scan(self) -> None:
        text = self.text
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    self._string_done(text[self._string_start:i + 1])
                continue
            if c == '"':
                self._in_string, self._string_start = True, i
            elif c in "{[":
                self._depth += 1
                if self._depth == self.call_depth and c == "{":
                    self.calls.append(_CallScan())
                    self._key, self._expect_value = None, False
                elif self._depth == self.call_depth + 1 and self._key in self.args_keys and self.calls:
                    self.calls[-1].args_start = self.calls[-1].args_sent = i
            elif c in "}]":
                if self._depth == self.call_depth + 1 and self._key in self.args_keys and self.calls:
                    self.calls[-1].args_end = i + 1
                self._depth -= 1
            elif self._depth == self.call_depth and c == ":":
                self._expect_value = True
            elif self._depth == self.call_depth and c == ",":
                self._key, self._expect_value = None, False
        self._pos = len(text)

    def _string_done(self, literal: str) -> None:
        if self._depth != self.call_depth or not self.calls:
            return
        try:
            value = json.loads(literal)
        except json.JSONDecodeError:
            return
        if not self._expect_value:
            self._key = value
        elif self._key == "name":
            self.calls[-1].name = str(value)

    def _deltas(self) -> list[DeltaToolCall]:
        out = []
        for k, call in enumerate(self.calls):
            if call.name is None:
                break  # calls start in order: a later one waits for this one's name
            if not call.started:
                call.started = True
                out.append(DeltaToolCall(index=self.index_base + k, id=random_id("call"), type="function",
                                         function=DeltaFunctionCall(name=call.name, arguments="")))
            if call.args_start is not None:
                end = call.args_end if call.args_end is not None else len(self.text)
                if end > call.args_sent:
                    out.append(DeltaToolCall(index=self.index_base + k, function=DeltaFunctionCall(
                        arguments=self.text[call.args_sent:end])))
                    call.args_sent = end
        return out


@dataclass
class HermesStream:
    """Streams the text before the first `<tool_call>` (holding back anything that may start one), then
    each call as it is written: its name once complete, then its arguments (`call_deltas`)."""

    text: str = ""
    sent: int = 0
    in_call: bool = field(default=False)
    _blocks: list[ConstrainedCallStream] = field(default_factory=list)
    _block_open: bool = False
    _scanned: int = 0  # text up to here went to the block scanners (or is outside blocks)

    def feed(self, delta: str) -> str:
        """Add new output; return the content that can be sent now."""
        self.text += delta
        if self.in_call:
            return ""
        start = self.text.find(HERMES_OPEN, self.sent)
        if start >= 0:
            self.in_call = True
            end = start
        else:
            # A tail that is a prefix of "<tool_call>" waits for the next delta.
            end = len(self.text) - held_prefix(self.text[self.sent:], HERMES_OPEN)
        out, self.sent = self.text[self.sent:end], end
        return out

    def call_deltas(self) -> list[DeltaToolCall]:
        """The pieces of calls written since the last call: one `<tool_call>` block is one call."""
        out: list[DeltaToolCall] = []
        pos = max(self._scanned, self.sent)
        while self.in_call:
            if not self._block_open:
                start = self.text.find(HERMES_OPEN, pos)
                if start < 0:
                    break
                self._blocks.append(ConstrainedCallStream(None, call_depth=1, args_keys=("arguments", "parameters"),
                                                          index_base=len(self._blocks)))
                self._block_open, pos = True, start + len(HERMES_OPEN)
            end = self.text.find(HERMES_CLOSE, pos)
            # Hold back a tail that may be the start of the closing tag.
            upto = end if end >= 0 else max(pos, len(self.text) - len(HERMES_CLOSE) + 1)
            out += self._blocks[-1].feed(self.text[pos:upto])
            pos = upto
            if end < 0:
                break
            self._block_open, pos = False, end + len(HERMES_CLOSE)
        self._scanned = pos
        return out

    @property
    def streamed_calls(self) -> int:
        """How many calls went out (or began to) through `call_deltas`."""
        return sum(1 for block in self._blocks for call in block.calls if call.started)

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """At the end: (the content not sent yet, the calls); everything unsent starts at the first call."""
        return parse_hermes(self.text[self.sent:])


@dataclass
class ToolPlan:
    """How a request's output becomes tool calls: one named function's arguments, a list of calls, or
    (auto) whatever calls the model wrote in its own format."""

    schema: dict[str, Any] | None  # the constraint; None for auto
    named: str | None = None  # the forced function; None for "required" (a JSON list of {name, parameters})
    parser: Any = None  # auto: the model family's format (a servelm.entrypoints.tool_parsers.ToolParser)

    @property
    def auto(self) -> bool:
        return self.schema is None

    def json_schema(self) -> str | None:
        return None if self.schema is None else json.dumps(self.schema)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. Output that reads as no call (a "required" list cut off by
        max_tokens) stays visible as the content."""
        if self.auto:
            return self.parser.parse(text)
        if self.named is not None:
            return None, [ToolCall(id=random_id("call"), function=FunctionCall(name=self.named, arguments=text))]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [ToolCall(id=random_id("call"), function=FunctionCall(
            name=item["name"], arguments=json.dumps(item["parameters"]))) for item in items]

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        # As vLLM: a forced (named) call finishes with "stop"; "required" and auto with "tool_calls".
        if self.named is None and reason == "stop" and calls:
            return "tool_calls"
        return reason


def plan_tool_calls(tools: list[ChatTool] | None, tool_choice: str | NamedToolChoice | None,
                    parser: Any = None, parallel: bool = True) -> ToolPlan | None:
    """None when the output is free text; ValueError (about tool_choice) when the choice cannot be served.
    `parser`: the --tool-call-parser's `ToolParser` for this request's tools (auto needs one)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        if parser is None:
            raise ValueError(AUTO_UNSUPPORTED)
        return ToolPlan(None, parser=parser)
    by_name = {t.function.name: t for t in tools}
    if isinstance(tool_choice, NamedToolChoice):
        tool = by_name.get(tool_choice.function.name)
        if tool is None:
            raise ValueError(f"tool_choice names the function '{tool_choice.function.name}', which is not in "
                             f"tools ({', '.join(by_name)})")
        return ToolPlan(tool.function.parameters or {"type": "object"}, named=tool.function.name)
    call_schemas = [{"type": "object",
                     "properties": {"name": {"type": "string", "enum": [name]},
                                    "parameters": tool.function.parameters or {"type": "object"}},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for name, tool in by_name.items()]
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}}
    if not parallel:
        calls["maxItems"] = 1
    return ToolPlan(calls)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them.

    Templates write a call's arguments with `| tojson`, so they get the object, not the JSON text the API
    carries (as vLLM does); otherwise the model would see the arguments encoded twice. ValueError when the
    arguments are not JSON.
    """
    out = []
    for m in messages:
        msg = {"role": m.role, "content": m.text(),
               **m.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)}
        for call in msg.get("tool_calls", []):
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    raise ValueError(f"messages: tool call arguments are not valid JSON: {fn['arguments'][:80]}") \
                        from None
        out.append(msg)
    return out
