"""The wire's sampling parameters are SamplingParams' fields: each field is either accepted on every route or
named as the engine's own (`ENGINE_ONLY_PARAMS`), so a new field is a decision, never forgotten on one side."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from streamd.config import ServerConfig
from streamd.engine import SamplingParams
from streamd.server.errors import ServiceError
from streamd.server.generation import ENGINE_ONLY_PARAMS, WIRE_ALIASES, WIRE_PARAMS, Generation

FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def test_every_sampling_field_is_on_the_wire_or_named_engine_only() -> None:
    assert ENGINE_ONLY_PARAMS <= FIELDS, "an engine-only name that is no SamplingParams field"
    assert not WIRE_ALIASES & FIELDS
    assert {name for name in FIELDS if (name in WIRE_PARAMS) == (name in ENGINE_ONLY_PARAMS)} == set()
    assert WIRE_PARAMS - FIELDS == WIRE_ALIASES
    assert {"max_tokens", "temperature", "structured_outputs", "timeout_s", "response_format"} <= WIRE_PARAMS


def _generation() -> Generation:
    engine: Any = SimpleNamespace(tokenizer=None, max_model_len=64)
    return Generation(engine, ServerConfig(), lifecycle=None, metrics=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(ENGINE_ONLY_PARAMS))
def test_engine_only_fields_are_refused_naming_them(name: str) -> None:
    with pytest.raises(ServiceError, match=name):
        _generation().prepare([1, 2, 3], {name: 1.0}, default_max_tokens=8)


def test_wire_fields_pass_the_name_check() -> None:
    """Every wire name gets past the unknown-parameter check (its value is then SamplingParams' to judge)."""
    generation = _generation()
    for name in sorted(WIRE_PARAMS):
        try:
            generation.prepare([1, 2, 3], {name: None}, default_max_tokens=8)
        except ServiceError as exc:  # pragma: no cover - the failure names the parameter
            pytest.fail(f"{name} refused: {exc}")
