"""Tool calls in a model's reply text -> OpenAI `tool_calls`, as the text streams.

Two formats, chosen from the model's chat template (`tool_format`):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, after
  optional text (NousResearch Hermes 2/3, Qwen2.5, Qwen3 and the templates that copied them);
- "json": the reply is the call itself, `{"name": ..., "parameters": {...}}` (Llama 3.1 / 3.2 / 3.3, whose
  `<|python_tag|>` is a special token the detokenizer already dropped), several separated by ";".
  A grammar-enforced reply (`tool_choice` "required" or a named function: `{"name", "arguments"}`) is read
  with the same parser.
A template that defines neither (SmolLM2's, for one) gets no parser: `tool_choice="auto"` replies are text.

`ToolCallParser.feed(piece)` returns what is new since the last call: content text the client may show and
OpenAI tool-call deltas (the first of each call carries its id and name, later ones pieces of its JSON
`arguments`, in the model's own spelling). Text that could still turn out to be (part of) a call is held back
until it is decided; `feed("", final=True)` at the end releases it. Parsing re-reads the reply so far on
every piece (replies are short; no state machine to get wrong).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_JSON_CALL_START = '{"name":'  # what a "json" reply starts with (whitespace removed) when it is a call


def tool_format(chat_template: Any) -> str | None:
    """The tool-call format a chat template teaches its model: "hermes", "json" or None."""
    if not isinstance(chat_template, str):
        return None
    if _HERMES_OPEN in chat_template:
        return "hermes"
    if '"parameters": dictionary of argument name and its value' in chat_template:
        return "json"
    return None


@dataclass(slots=True)
class _CallView:
    """One call as far as the text shows it: its name once known, its arguments text so far."""

    name: str | None
    arguments: str
    complete: bool
    valid: bool  # complete, and the whole call parses as {"name": str, "arguments"|"parameters": object}


@dataclass(slots=True)
class ToolDeltas:
    content: str
    tool_calls: list[dict[str, Any]]


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass(slots=True)
class _SentCall:
    id: str
    name: str
    arguments: int = 0  # characters of the arguments already sent


@dataclass(slots=True)
class ToolCallParser:
    format: str  # "hermes" or "json"
    text: str = ""
    _content: int = 0  # characters of content already sent
    _sent: list[_SentCall] = field(default_factory=list)

    def feed(self, piece: str, final: bool = False) -> ToolDeltas:
        self.text += piece
        content, views = _split(self.format, self.text, final)
        new_content, self._content = content[self._content:], max(self._content, len(content))
        deltas: list[dict[str, Any]] = []
        for i, view in enumerate(views):
            if i == len(self._sent):
                if view.name is None:
                    break
                self._sent.append(_SentCall("call_" + uuid.uuid4().hex[:24], view.name))
                deltas.append({"index": i, "id": self._sent[i].id, "type": "function",
                               "function": {"name": view.name, "arguments": ""}})
            sent = self._sent[i]
            if len(view.arguments) > sent.arguments:
                deltas.append({"index": i, "function": {"arguments": view.arguments[sent.arguments:]}})
                sent.arguments = len(view.arguments)
        return ToolDeltas(new_content, deltas)

    def result(self) -> ParsedReply:
        """The whole reply (non-streamed): its content (None when empty) and its complete, valid calls. A
        reply with no valid call is all content."""
        content, views = _split(self.format, self.text, final=True)
        calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                  "function": {"name": view.name, "arguments": view.arguments}} for view in views if view.valid]
        if not calls:
            return ParsedReply(self.text, [])
        return ParsedReply(content if content.strip() else None, calls)

    @property
    def called(self) -> bool:
        """Whether the reply so far holds a complete, valid call (its finish reason is then "tool_calls")."""
        return any(view.valid for view in _split(self.format, self.text, final=True)[1])


def _split(fmt: str, text: str, final: bool) -> tuple[str, list[_CallView]]:
    """The reply so far -> (content that is certainly not part of a call, the calls). At the end, a reply
    none of whose calls got as far as a name is all content (e.g. a Llama reply that is JSON, not a call)."""
    content, calls = _split_hermes(text, final) if fmt == "hermes" else _split_json(text, final)
    if final and not any(call.name is not None for call in calls):
        return text, []
    return content, calls


def _split_hermes(text: str, final: bool) -> tuple[str, list[_CallView]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return (text if final else text[:len(text) - _partial_tag(text, _HERMES_OPEN)]), []
    calls = []
    while start >= 0:
        body_start = start + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_start)
        if end < 0:
            body = text[body_start:] if final else text[body_start:len(text) - _partial_tag(text, _HERMES_CLOSE)]
            calls.append(_call_view(body, complete=final))
            break
        calls.append(_call_view(text[body_start:end], complete=True))
        start = text.find(_HERMES_OPEN, end)
    return text[:text.find(_HERMES_OPEN)], calls


def _split_json(text: str, final: bool) -> tuple[str, list[_CallView]]:
    compact = re.sub(r"\s+", "", text)
    if not compact.startswith(_JSON_CALL_START):
        if not final and _JSON_CALL_START.startswith(compact):
            return "", []  # still undecided (empty, "{", '{"na', ...)
        return text, []
    calls, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            break
        end = _object_end(text, pos)
        calls.append(_call_view(text[pos:end if end > 0 else len(text)], complete=end > 0 or final))
        if end < 0:
            break
        pos = end
    return "", calls


def _call_view(body: str, complete: bool) -> _CallView:
    """A call's JSON text so far. The arguments are streamed as the model spells them; the last character
    (possibly the call's own closing brace) is held back until the call is complete."""
    head = _CALL_HEAD.match(body)
    valid = complete and _parses_as_call(body)
    if head is None:
        if valid:  # a complete call in another key order: sent whole
            call = json.loads(body)
            return _CallView(call["name"], json.dumps(call.get("arguments", call.get("parameters"))), True, True)
        return _CallView(None, "", complete, False)
    arguments = body[head.end():].rstrip()[:-1]
    return _CallView(json.loads(head.group(1)), arguments, complete, valid)


def _parses_as_call(body: str) -> bool:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return False
    args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
    return isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(args, dict)


def _object_end(text: str, start: int) -> int:
    """The index after the JSON object that opens at `start`, or -1 while it is not closed yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
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
    return -1


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
