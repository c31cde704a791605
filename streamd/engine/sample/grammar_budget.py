"""What a structured-output spec may cost to compile, judged before xgrammar sees it (plain Python: the
server measures specs too, without torch).

An xgrammar compile cannot be interrupted, and its cost grows steeply with a few things a spec states
cheaply. Measured on the default model's 49k-token vocabulary (one compile thread pair, a shared 2-core
host): an object's optional properties (400: 0.3 s, 1,000: 2.1 s, 2,000: 104 s), enum values or choice
items (3,000: 0.75 s; a 1 MB choice: 88 s), counted repetitions (`minLength: 5000`: 5.5 s, a regex's
`{1000,5000}`: 1.0 s), nesting (600 levels: ~20 s). `grammar_size` reads those off a spec in one walk;
`GrammarBudget.check` refuses a spec over any limit, naming it; a spec that is short and counts nothing far
is `light` (it compiles in milliseconds), and the server lets only heavy ones take a compile slot.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from streamd.config import GrammarConfig
from streamd.engine.errors import RequestError
from streamd.engine.sampling_params import StructuredOutputs

# Light specs (compile in milliseconds: never wait for a compile slot): at most this long, no count above this.
LIGHT_CHARS = 4096
LIGHT_REPEAT = 64
_LENGTH_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_COUNTED = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # a regex's (or GBNF's) {m}, {m,}, {m,n}
_HUGE = 1 << 31  # counts are clamped here: a 400-digit count is simply "too many"


class GrammarError(RequestError):
    """A structured-output spec that cannot be compiled (bad schema, unsupported feature, bad grammar, or
    over the compile budget)."""


@dataclass(slots=True, frozen=True)
class SpecSize:
    """What makes a spec costly to compile."""

    kind: str  # the spec's field: "json", "json_object", "regex", "choice" or "grammar"
    chars: int  # its text: the schema's JSON, the regex, the choices, the grammar
    depth: int  # how deeply a schema's objects and arrays nest
    properties: int  # object properties, every object of a schema together
    alternatives: int  # enum values and choice items
    repeat: int  # the largest counted repetition (a length or item bound, a regex's {m,n})
    # A JSON schema's compact text (property order kept), as measured: what the engine hands xgrammar, so
    # a schema is parsed and printed once per compile.
    schema: str | None = field(default=None, repr=False, compare=False)

    @property
    def light(self) -> bool:
        return self.chars <= LIGHT_CHARS and self.repeat <= LIGHT_REPEAT


@dataclass(slots=True, frozen=True)
class GrammarBudget:
    """The largest spec the engine compiles (config section `grammar`, whose defaults these are: `of`); a real
    application stays far below."""

    max_chars: int
    max_depth: int
    max_properties: int
    max_alternatives: int
    max_repeat: int

    @classmethod
    def of(cls, config: GrammarConfig) -> GrammarBudget:
        c = config
        return cls(c.max_chars, c.max_depth, c.max_properties, c.max_alternatives, c.max_repeat)

    def check(self, size: SpecSize) -> None:
        """Raises GrammarError naming the first limit `size` exceeds."""
        name = f"structured_outputs.{size.kind}"
        if size.depth > self.max_depth:
            raise GrammarError(
                f"{name} is nested too deeply ({size.depth} levels of objects and arrays; at most "
                f"{self.max_depth}, grammar.max_depth)"
            )
        for what, value, limit, key in (
            ("characters", size.chars, self.max_chars, "max_chars"),
            ("object properties", size.properties, self.max_properties, "max_properties"),
            ("enum values or choices", size.alternatives, self.max_alternatives, "max_alternatives"),
            ("as the largest repetition count or length bound", size.repeat, self.max_repeat, "max_repeat"),
        ):
            if value > limit:
                raise GrammarError(f"{name} is too complex to compile: {value} {what} (at most {limit}, grammar.{key})")


def grammar_size(spec: StructuredOutputs) -> SpecSize:
    """The spec's size (a JSON schema given as text is parsed: GrammarError when it is not a JSON object)."""
    if spec.json is not None:
        return _schema_size(schema_object(spec.json))
    if spec.regex is not None:
        return SpecSize("regex", len(spec.regex), 0, 0, 0, _counted(spec.regex))
    if spec.choice is not None:
        return SpecSize("choice", sum(len(c) + 1 for c in spec.choice), 0, 0, len(spec.choice), 0)
    if spec.grammar is not None:
        return SpecSize("grammar", len(spec.grammar), 0, 0, 0, _counted(spec.grammar))
    return SpecSize("json_object", 0, 0, 0, 0, 0)


def schema_object(schema: dict[str, Any] | str) -> dict[str, Any]:
    """A `structured_outputs.json` value as a schema object (parsed when given as JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise GrammarError(f"structured_outputs.json is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise GrammarError("structured_outputs.json must be a JSON schema object")
    return schema


def _schema_size(schema: dict[str, Any]) -> SpecSize:
    """One walk of a schema (iterative: no recursion limit to hit)."""
    depth = properties = alternatives = repeat = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    children: Iterable[Any]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            properties += len(item["properties"]) if isinstance(item.get("properties"), dict) else 0
            alternatives += len(item["enum"]) if isinstance(item.get("enum"), list) else 0
            repeat = max(repeat, _bounds(item))
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    text = json.dumps(schema)
    return SpecSize("json", len(text), depth, properties, alternatives, repeat, text)


def _bounds(node: dict[str, Any]) -> int:
    """The largest length/item bound of one schema node, its `pattern`'s counted repetitions included."""
    counts = [min(v, _HUGE) for k in _LENGTH_KEYS if isinstance(v := node.get(k), int) and not isinstance(v, bool)]
    pattern = node.get("pattern")
    return max([*counts, _counted(pattern) if isinstance(pattern, str) else 0])


def _counted(text: str) -> int:
    """The largest count of a regex's (or grammar's) counted repetitions."""
    return max((_HUGE if len(n) > 9 else int(n) for m in _COUNTED.finditer(text) for n in m.groups() if n), default=0)
