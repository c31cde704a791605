"""OpenAI wire fields for structured outputs and tool calling, turned into engine terms and back.

- `response_format` ({"type": "text" | "json_object" | "json_schema"}) -> the `structured_outputs` dict of
  SamplingParams (vLLM's own `structured_outputs` field is accepted as is).
- `tools` + `tool_choice` -> `ToolPlan`: the tools the chat template receives, and for "required" or a
  named function the JSON schema every reply must follow (`{"name": ..., "arguments": {...}}`), so tool
  calls work with any model. "auto" lets the model answer freely (no parser of model-specific tool-call
  formats yet: see README); "none" hides nothing from the template but never calls.
- `ToolCallStream`: the grammar-enforced reply text, followed as it streams, -> OpenAI `tool_calls`
  (an id, the function name, then JSON-string `arguments` in pieces).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from streamd.server.errors import ServiceError


def structured_from_response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI `response_format` -> `structured_outputs` (None for plain text)."""
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ServiceError("invalid_request", "response_format must be an object with type \"text\", "
                           "\"json_object\" or \"json_schema\"", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ServiceError("invalid_request", "response_format.json_schema.schema must be a JSON schema object",
                           "response_format")
    return {"json": schema}


@dataclass(slots=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool objects, for the chat template
    structured: dict[str, Any] | None  # the call schema when the call is grammar-enforced


def plan_tools(tools: Any, tool_choice: Any) -> ToolPlan | None:
    """Validates `tools` / `tool_choice`; None when the request has no tools."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ServiceError("invalid_request", "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ServiceError("invalid_request", "tools must be a list of function tools", "tools")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ServiceError("invalid_request", f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"parameters\": {...}}}", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ServiceError("invalid_request", f"tools[{i}].function.parameters must be a JSON schema object",
                               "tools")
        functions[fn["name"]] = params
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return ToolPlan(tools, None)
    if choice == "required":
        return ToolPlan(tools, {"json": {"anyOf": [_call_schema(n, p) for n, p in functions.items()]}})
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in functions:
        raise ServiceError("invalid_request", "tool_choice must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": NAME}} naming one of tools",
                           "tool_choice")
    return ToolPlan(tools, {"json": _call_schema(name, functions[name])})


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


_ARGS_KEY = '"arguments":'


@dataclass(slots=True)
class ToolCallStream:
    """Follows the text of one grammar-enforced call `{"name": "...", "arguments": {...}}` and yields
    OpenAI tool-call deltas: the first carries the id and the name, later ones pieces of the arguments.
    The outer object's closing brace is always held back (it is not part of the arguments)."""

    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    text: str = ""
    name: str | None = None
    args_start: int = -1
    sent: int = 0  # characters of the arguments already sent

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        out: list[dict[str, Any]] = []
        if self.name is None:
            at = self.text.find(_ARGS_KEY)
            if at < 0:
                return out
            self.name = json.loads(self.text[:at].rstrip(" ,") + "}")["name"]
            self.args_start = at + len(_ARGS_KEY)
            out.append({"index": 0, "id": self.id, "type": "function",
                        "function": {"name": self.name, "arguments": ""}})
        available = self.text[self.args_start:-1].lstrip()
        if len(available) > self.sent:
            out.append({"index": 0, "function": {"arguments": available[self.sent:]}})
            self.sent = len(available)
        return out

    def final(self) -> dict[str, Any] | None:
        """The whole call (non-streamed replies), or None if the text is not a complete call."""
        try:
            call = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        return {"id": self.id, "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
