"""Grammar backends compared on this machine (issue 14): llguidance vs xgrammar.

For each of a handful of real-world JSON schemas: compile time (cold, no cache) and the time to fill the
token bitmask per token, for one sequence and for 64 at once, while following a valid document token by
token. Tokenizer: the default model's (SmolLM2). Run:

    PYTHONPATH=$PWD python benchmarks/grammar_backends.py [--out results/grammar-backends.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person (nested object, enum, pattern)": ({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                        "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "age", "email", "role", "address"], "additionalProperties": False,
    }, {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org", "role": "admin",
        "address": {"city": "London", "zip": "12345"}}),
    "order (array of objects)": ({
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
            "paid": {"type": "boolean"},
        },
        "required": ["order_id", "items", "paid"], "additionalProperties": False,
    }, {"order_id": "A-17", "items": [{"sku": "pen", "qty": 3, "price": 1.5}, {"sku": "ink", "qty": 1,
        "price": 9.99}], "paid": True}),
    "event (anyOf)": ({
        "type": "object",
        "properties": {"event": {"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "click"}, "x": {"type": "integer"},
                                              "y": {"type": "integer"}}, "required": ["kind", "x", "y"],
             "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "key"}, "key": {"type": "string"}},
             "required": ["kind", "key"], "additionalProperties": False}]},
            "ts": {"type": "number"}},
        "required": ["event", "ts"], "additionalProperties": False,
    }, {"event": {"kind": "key", "key": "Enter"}, "ts": 1712.5}),
    "tool call (OpenAI function)": ({
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
            "location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["location", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False,
    }, {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}}),
    "free json_object": ({"type": "object"}, {"title": "a note", "tags": ["x", "y"], "n": 3, "ok": None}),
}


def _time(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_llguidance(hf_tok: Any, schema: dict[str, Any], doc_ids: list[int], batch: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = _cached("llg_tok", lambda: llguidance.hf.from_tokenizer(hf_tok))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    compile_s = _time(lambda: llguidance.LLMatcher(tok, grammar))  # first matcher compiles the grammar
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
    bitmask = llguidance.torch.allocate_token_bitmask(batch, tok.vocab_size)
    pool = _cached("llg_pool", lambda: ThreadPoolExecutor(2))
    per_token = []
    for t in doc_ids:
        if batch == 1:
            per_token.append(_time(lambda: llguidance.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)))
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            per_token.append(_time(lambda: llguidance.torch.fill_next_token_bitmask_par(
                _cached("llg_exec", lambda: llguidance.LLExecutor()), pairs, bitmask)))
        for m in matchers:
            assert m.consume_token(t), m.get_error()
    del pool
    return {"compile_ms": compile_s * 1e3, "mask_us_median": statistics.median(per_token) * 1e6,
            "mask_us_p99": sorted(per_token)[int(0.99 * (len(per_token) - 1))] * 1e6}


def bench_xgrammar(hf_tok: Any, schema: dict[str, Any], doc_ids: list[int], batch: int) -> dict[str, float]:
    import xgrammar as xgr

    info = _cached("xgr_info", lambda: xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok)))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled: list[Any] = []
    compile_s = _time(lambda: compiled.append(compiler.compile_json_schema(json.dumps(schema))))
    matchers = [xgr.GrammarMatcher(compiled[0]) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, info.vocab_size)
    per_token = []
    for t in doc_ids:
        if batch == 1:
            per_token.append(_time(lambda: matchers[0].fill_next_token_bitmask(bitmask, 0)))
        else:
            batch_matcher = _cached("xgr_batch", lambda: xgr.BatchGrammarMatcher(max_threads=2)) \
                if hasattr(xgr, "BatchGrammarMatcher") else None
            if batch_matcher is not None:
                per_token.append(_time(lambda: batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)))
            else:
                per_token.append(_time(lambda: [m.fill_next_token_bitmask(bitmask, i)
                                                for i, m in enumerate(matchers)]))
        for m in matchers:
            assert m.accept_token(t)
    return {"compile_ms": compile_s * 1e3, "mask_us_median": statistics.median(per_token) * 1e6,
            "mask_us_p99": sorted(per_token)[int(0.99 * (len(per_token) - 1))] * 1e6}


_CACHE: dict[str, Any] = {}


def _cached(key: str, make: Any) -> Any:
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tests.smollm2_tokenizer import smollm2_tokenizer

    hf_tok = smollm2_tokenizer()
    results = []
    for name, (schema, doc) in SCHEMAS.items():
        doc_ids = hf_tok(json.dumps(doc), add_special_tokens=False).input_ids
        for backend, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            for batch in (1, 64):
                r = {"schema": name, "backend": backend, "batch": batch, "tokens": len(doc_ids),
                     **fn(hf_tok, schema, doc_ids, batch)}
                results.append(r)
                print(f"{name:40s} {backend:10s} b={batch:3d} compile {r['compile_ms']:8.1f} ms  "
                      f"mask {r['mask_us_median']:9.1f} us (p99 {r['mask_us_p99']:9.1f})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
