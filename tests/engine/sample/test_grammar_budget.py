"""The grammar compile budget (what a spec states that makes it slow to compile) and the bounded cache."""

from __future__ import annotations

import pytest

from streamd.config import GrammarConfig
from streamd.engine.sample.grammar import GrammarCompiler
from streamd.engine.sample.grammar_budget import GrammarBudget, GrammarError, grammar_size
from streamd.engine.sampling_params import StructuredOutputs
from tests.smollm2_tokenizer import smollm2_tokenizer


def test_a_spec_is_measured_in_one_walk() -> None:
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 8},
        "name": {"type": "string", "pattern": "^[a-z]{2,40}$"}}}
    size = grammar_size(StructuredOutputs(json=schema))
    assert (size.kind, size.depth, size.properties, size.alternatives, size.repeat) == ("json", 5, 2, 3, 40)
    assert size.light
    assert not grammar_size(StructuredOutputs(regex="[0-9]{1000}")).light  # short, but counts far
    assert not grammar_size(StructuredOutputs(choice=["x" * 100] * 50)).light  # long
    assert grammar_size(StructuredOutputs(regex="a{" + "9" * 5000 + "}")).repeat == 1 << 31  # no int() of it


def test_the_first_limit_exceeded_is_named() -> None:
    budget = GrammarBudget.of(GrammarConfig(max_properties=10))
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(11)}}
    with pytest.raises(GrammarError, match=r"11 object properties \(at most 10, grammar.max_properties\)"):
        budget.check(grammar_size(StructuredOutputs(json=many)))
    with pytest.raises(GrammarError, match="grammar.max_depth"):
        deep: dict = {"type": "string"}
        for _ in range(70):
            deep = {"type": "array", "items": deep}
        budget.check(grammar_size(StructuredOutputs(json=deep)))


def test_the_compiled_grammar_cache_stays_within_its_bytes() -> None:
    """Issue 35 D3: 400 distinct small schemas kept ~1.5 MB each for ever; now least recently used go."""
    limit = 4 << 20  # about three of these schemas (each ~1.25 MB compiled)
    compiler = GrammarCompiler(smollm2_tokenizer(), 49152, [2], GrammarBudget.of(GrammarConfig()), limit)
    for i in range(12):
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 20}}}
        compiler.compile(StructuredOutputs(json=schema))
        assert compiler.cache_bytes() <= limit
    assert compiler.cache_bytes() > 0
