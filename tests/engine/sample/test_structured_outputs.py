"""Structured outputs in the engine: grammar-gated sampling (xgrammar), matchers that follow every kept token,
mixed batches, preemption by swap and by recompute, dead ends and bad specs. A random-weight Llama with the
real SmolLM2 tokenizer keeps these fast: whatever its weights say, the grammar decides what is valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import LlamaConfig

from streamd.config import load_config
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.sample.grammar import GrammarError
from streamd.engine.sampling_params import SamplingParams, StructuredOutputs
from streamd.engine.worker.model_loader import load_model
from tests.helpers import register_engine, run_to_completion, step_until_idle
from tests.smollm2_tokenizer import smollm2_tokenizer

TINY = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   initializer_range=0.5, eos_token_id=2, bos_token_id=1)
# A finite language (enums, bounded integers, booleans): every document ends well inside max_tokens.
FINITE = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}},
    "required": ["color", "n", "ok", "tags"], "additionalProperties": False}
PROMPTS = [[1, 5 + i, 700 + 13 * i, 42, 9000 + i] * (2 + i % 5) for i in range(8)]


def tiny_engine(**overrides) -> LLMEngine:
    base = {"model.device": "cpu", "model.dtype": "float32", "cache.block_size": 8,
            "scheduler.max_num_batched_tokens": 64, "model.seed": 3, "cache.num_swap_blocks": 0}
    config = load_config(None, {**base, **overrides})
    loaded = load_model(TINY, torch.float32, torch.device("cpu"), seed=3)
    loaded.tokenizer = smollm2_tokenizer()
    return register_engine(LLMEngine(config, loaded, torch.device("cpu")))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return tiny_engine(**{"cache.num_kv_blocks": 400})


def constrained(temperature: float = 0.0, **kw) -> SamplingParams:
    # The longest FINITE document is 66 characters: even one token a character ends before max_tokens.
    return SamplingParams(temperature=temperature, max_tokens=80, seed=kw.pop("seed", None),
                          structured_outputs=StructuredOutputs(json=FINITE), **kw)


def check_valid(texts: list[str]) -> None:
    for text in texts:
        jsonschema.validate(json.loads(text), FINITE)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_validate(engine: LLMEngine, temperature: float) -> None:
    outs = run_to_completion(engine, PROMPTS, constrained(temperature))
    check_valid([o.outputs[0].text for o in outs])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_every_parallel_sample_follows_its_own_grammar_state(engine: LLMEngine) -> None:
    # n > 1: each sample forks its prompt's matcher and then advances on its own tokens only.
    outs = run_to_completion(engine, PROMPTS[:4], constrained(1.0, n=4, seed=11))
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 16 and len(set(texts)) > 4, texts  # distinct samples, each a valid document
    check_valid(texts)
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert engine.grammars is not None and len(engine.grammars) == 0  # every matcher went with its sequence


def test_unconstrained_neighbour_is_unaffected(engine: LLMEngine) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    solo = run_to_completion(engine, PROMPTS[:1], plain)[0].outputs[0].token_ids
    mixed = run_to_completion(engine, PROMPTS[:3], [plain, constrained(), constrained(1.0, seed=4)])
    assert mixed[0].outputs[0].token_ids == solo
    check_valid([o.outputs[0].text for o in mixed[1:]])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_constrained_requests_survive_preemption(engine: LLMEngine, mode: str) -> None:
    # 16 blocks of 8 tokens cannot hold these 8 sequences at once (their prompts alone need 24): most of the
    # batch gets preempted. (One sequence's worst case, 30 prompt + 80 tokens, fits: 14 blocks.)
    tight = tiny_engine(**{"cache.num_kv_blocks": 16, "cache.num_swap_blocks": 64 if mode == "swap" else 0,
                           "scheduler.preemption_mode": mode, "cache.watermark": 0.0})
    outs = run_to_completion(tight, PROMPTS, constrained(1.0, seed=9))
    check_valid([o.outputs[0].text for o in outs])
    # Seeded: the same tokens as on a pool that never preempts (a matcher left out of step after a swap or a
    # recompute would mask other tokens, or allow ones the grammar forbids).
    roomy = run_to_completion(engine, PROMPTS, constrained(1.0, seed=9))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    stats = tight.stats().scheduler
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0, stats
    assert tight.grammars is not None and len(tight.grammars) == 0


def test_choice_regex_and_grammar(engine: LLMEngine) -> None:
    specs = [StructuredOutputs(choice=["yes", "no", "maybe so"]), StructuredOutputs(regex=r"[A-Z]{3}-[0-9]{2}"),
             StructuredOutputs(grammar='root ::= "(" [0-9] ("+" [0-9])? ")"')]
    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=s) for s in specs]
    texts = [o.outputs[0].text for o in run_to_completion(engine, PROMPTS[:3], params)]
    assert texts[0] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", texts[1]), texts[1]
    assert re.fullmatch(r"\([0-9](\+[0-9])?\)", texts[2]), texts[2]


def test_dead_end_ends_the_request_with_a_reason(engine: LLMEngine) -> None:
    # min_tokens masks EOS while the finished grammar allows nothing else: a dead end, not a crash.
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                            structured_outputs=StructuredOutputs(choice=["yes"]))
    engine.add_request("dead-end", PROMPTS[0], params)
    out = step_until_idle(engine)["dead-end"]
    assert out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].text == "yes"
    assert "dead end" in (out.error or ""), out


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, 'Unsupported type "strin"'),
    ({"json": _nested(70)}, "grammar.max_depth"),  # the engine's own compile budget, not only the server's
    ({"json": '{"type": '}, "structured_outputs.json is not valid JSON"),
    ({"regex": "(abc"}, "structured_outputs.regex cannot be compiled"),
    ({"grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
])
def test_bad_specs_are_refused_before_admission(engine: LLMEngine, spec: dict, message: str) -> None:
    used = engine.stats().kv
    with pytest.raises(GrammarError, match=message):
        engine.add_request("bad", PROMPTS[0], SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests() and engine.stats().kv == used


@pytest.mark.parametrize("spec, message", [
    ({}, "exactly one of"), ({"json": {}, "regex": "a"}, "exactly one of"), ({"choice": []}, "choice"),
    ({"jsn": {}}, "unknown key"),
])
def test_bad_spec_fields_are_named(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict({"structured_outputs": spec})
