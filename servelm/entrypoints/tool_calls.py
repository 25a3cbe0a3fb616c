"""OpenAI tool calls (`tools` + `tool_choice`) through structured outputs, as vLLM does it.

A named function or `tool_choice="required"` turns into a JSON schema that the
output must follow (servelm.constrained), so the call is well formed whatever
the model; the text is then read back as tool calls. `"auto"` would need a
parser for each model family's own tool-call format, which servelm does not
have yet: it is refused with a message that says what to use instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from servelm.entrypoints.openai_protocol import ChatTool, FunctionCall, NamedToolChoice, ToolCall, random_id

AUTO_UNSUPPORTED = ("tool_choice 'auto' (the default when tools are given) needs a parser for the model's own "
                    "tool-call format, which servelm does not have yet; pass tool_choice 'required', a named "
                    "function ({\"type\": \"function\", \"function\": {\"name\": ...}}) or 'none'")


@dataclass
class ToolPlan:
    """How a request's output becomes tool calls: one named function's arguments, or a list of calls."""

    schema: dict[str, Any]
    named: str | None = None  # the forced function; None for "required" (a JSON list of {name, parameters})

    def json_schema(self) -> str:
        return json.dumps(self.schema)

    def calls(self, text: str) -> list[ToolCall]:
        """The tool calls in a finished output (a truncated "required" list reads as no call)."""
        if self.named is not None:
            return [ToolCall(id=random_id("call"), function=FunctionCall(name=self.named, arguments=text))]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return []
        return [ToolCall(id=random_id("call"), function=FunctionCall(name=item["name"],
                                                                     arguments=json.dumps(item["parameters"])))
                for item in items]

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        # As vLLM: a forced (named) call finishes with "stop"; "required" with "tool_calls".
        if self.named is None and reason == "stop" and calls:
            return "tool_calls"
        return reason


def plan_tool_calls(tools: list[ChatTool] | None, tool_choice: str | NamedToolChoice | None) -> ToolPlan | None:
    """None when the output is free text; ValueError (about tool_choice) when the choice cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        raise ValueError(AUTO_UNSUPPORTED)
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
    return ToolPlan({"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}})
