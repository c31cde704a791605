"""OpenAI wire fields for structured outputs and tool calling, turned into engine terms and back.

- `response_format` ({"type": "text" | "json_object" | "json_schema"}), and the Responses API's `text.format`,
  -> the `structured_outputs` dict of SamplingParams (vLLM's own `structured_outputs` field is accepted as is,
  and so are vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, its names
  until 0.12: `GUIDED_ALIASES`). A request sets at most one of these ways.
- `tools` + `tool_choice` -> `ToolPlan`: the tools the chat template receives, for "required" or a
  named function the JSON schema every reply must follow (`{"name": ..., "arguments": {...}}`), so tool
  calls work with any model, and the format the reply's calls are read in (`tool_parsers.py`): "json"
  for an enforced call, the model's own format for "auto" (none where its chat template defines none:
  then the reply is text); "none" hides nothing from the template but never calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamd.server.errors import ServiceError

# vLLM's `guided_*` request fields -> the `structured_outputs` key each one sets.
GUIDED_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_from_fields(fields: dict[str, Any]) -> None:
    """Turns `response_format` and `guided_*` in a request's (non-null) params into `structured_outputs`, in
    place; more than one way of constraining the output is refused, naming the second."""
    given = [name for name in ("structured_outputs", "response_format", *GUIDED_ALIASES) if name in fields]
    ways = {name: _one_way(name, fields.pop(name)) for name in given}
    chosen = {name: value for name, value in ways.items() if value is not None}
    if len(chosen) > 1:
        first, second = list(chosen)[:2]
        raise ServiceError("invalid_request", f"give {first} or {second}, not both", second)
    if chosen:
        fields["structured_outputs"] = next(iter(chosen.values()))


def with_enforced_call(params: dict[str, Any], call_schema: dict[str, Any]) -> dict[str, Any]:
    """`params` with a required or named tool_choice's call schema as their `structured_outputs`; refused
    when they constrain the output another way already."""
    if any(params.get(name) for name in ("response_format", "structured_outputs", *GUIDED_ALIASES)):
        raise ServiceError(
            "invalid_request",
            "a required or named tool_choice cannot be combined with response_format or structured_outputs",
            "tool_choice",
        )
    return {**params, "structured_outputs": call_schema}


def _one_way(name: str, value: Any) -> Any:
    if name == "response_format":
        return structured_from_response_format(value)
    if name in GUIDED_ALIASES:
        return {GUIDED_ALIASES[name]: value}
    return value


def structured_from_response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI `response_format` -> `structured_outputs` (None for plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    spec = value.get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return _structured(kind, schema, "response_format", "json_schema.schema")


def structured_from_text_format(value: Any) -> dict[str, Any] | None:
    """The Responses API's `text.format` (the same three types; a json_schema's `schema` sits beside its
    `name` and `strict` rather than under `json_schema`) -> `structured_outputs`."""
    kind = value.get("type") if isinstance(value, dict) else None
    return _structured(kind, value.get("schema") if kind == "json_schema" else None, "text.format", "schema")


def _structured(kind: Any, schema: Any, param: str, schema_field: str) -> dict[str, Any] | None:
    """A format's type and (for "json_schema") schema -> `structured_outputs`; errors name `param` (the
    format's field) and, for a missing schema, its `schema_field` under it."""
    if kind not in ("text", "json_object", "json_schema"):
        raise ServiceError(
            "invalid_request", f'{param} must be an object with type "text", "json_object" or "json_schema"', param
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if not isinstance(schema, dict):
        raise ServiceError("invalid_request", f"{param}.{schema_field} must be a JSON schema object", param)
    return {"json": schema}


@dataclass(slots=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool objects, for the chat template
    structured: dict[str, Any] | None  # the call schema when the call is grammar-enforced
    parser: str | None  # the format the reply's tool calls are parsed in (None: the reply is text)


def plan_tools(tools: Any, tool_choice: Any, model_format: str | None = None) -> ToolPlan | None:
    """Validates `tools` / `tool_choice`; None when the request has no tools. `model_format`: the tool-call
    format of the model's chat template (`tool_parsers.tool_format`)."""
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
            raise ServiceError(
                "invalid_request",
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}',
                "tools",
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ServiceError(
                "invalid_request", f"tools[{i}].function.parameters must be a JSON schema object", "tools"
            )
        functions[fn["name"]] = params
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(tools, None, None)
    if choice == "auto":
        return ToolPlan(tools, None, model_format)
    if choice == "required":
        return ToolPlan(tools, {"json": {"anyOf": [_call_schema(n, p) for n, p in functions.items()]}}, "json")
    named: Any = choice.get("function") if isinstance(choice, dict) else None
    name: Any = named.get("name") if isinstance(named, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in functions:
        raise ServiceError(
            "invalid_request",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": NAME}} naming one of tools',
            "tool_choice",
        )
    return ToolPlan(tools, {"json": _call_schema(name, functions[name])}, "json")


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
