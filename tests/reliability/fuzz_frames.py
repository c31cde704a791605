"""Hypothesis strategies for the protocol fuzzer: client frames (and HTTP bodies) built from the full
Unicode range, lone surrogates included, with sizes at and over every limit of `LIMITS`, plus what the
fuzzer expects each one to get back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from streamd.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.reliability.util import LIMITS

ANY_CHAR = st.characters(exclude_categories=())  # every code point, surrogates included
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.one_of(st.text(ANY_CHAR, max_size=40), st.text(SURROGATE, min_size=1, max_size=2),
                 st.text(st.characters(codec="utf-8"), max_size=40))
CHARS = LIMITS["max_prompt_chars"]
# At and over max_prompt_chars (a token list at the limit is longer than the context: refused without a
# forward pass, which keeps the fuzzer fast).
BIG_PROMPT = st.sampled_from([[7] * CHARS, [7] * (CHARS + 1), "a" * (CHARS + 1)])
NUMBER = st.one_of(st.integers(-3, 3), st.integers(), st.floats(allow_nan=False),
                   st.sampled_from([1e-300, 1e300, -0.0, 2.0, 2.0000001]))
JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), NUMBER, TEXT),
                       lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)
STOP = st.one_of(TEXT, NUMBER, st.lists(TEXT, max_size=4),
                 st.sampled_from([MAX_STOP_STRINGS, MAX_STOP_STRINGS + 1]).map(lambda n: ["x"] * n),
                 st.sampled_from([MAX_STOP_CHARS, MAX_STOP_CHARS + 1]).map(lambda n: ["y" * n]))
SCHEMA_KEYS = st.sampled_from(["type", "properties", "items", "enum", "required", "anyOf", "$ref", "pattern"])
STRUCTURED = st.one_of(
    st.fixed_dictionaries({"json": st.one_of(JSONISH, st.dictionaries(SCHEMA_KEYS, JSONISH, max_size=4))}),
    st.fixed_dictionaries({"regex": TEXT}), st.fixed_dictionaries({"choice": st.lists(TEXT, max_size=3)}),
    st.fixed_dictionaries({"grammar": TEXT}), st.fixed_dictionaries({"json_object": st.booleans()}), JSONISH)
RESPONSE_FORMAT = st.one_of(JSONISH, st.fixed_dictionaries(
    {"type": st.sampled_from(["json_object", "json_schema", "text", "xml"])},
    optional={"json_schema": st.fixed_dictionaries({"name": TEXT, "schema": JSONISH})}))
PARAM_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(1, 3), st.integers(max_value=0), st.integers(min_value=10**4), JSONISH),
    "min_tokens": st.one_of(st.integers(0, 2), st.integers(), JSONISH),
    "temperature": st.one_of(st.floats(0, 2), NUMBER, JSONISH),
    "top_p": st.one_of(st.floats(0, 1), NUMBER), "top_k": st.one_of(st.integers(-2, 50), NUMBER),
    "min_p": NUMBER, "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
    "repetition_penalty": st.one_of(st.floats(0.5, 2), NUMBER), "stop": STOP,
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 60000), max_size=3), JSONISH),
    "seed": st.one_of(st.integers(), JSONISH), "n": st.one_of(st.integers(0, 3), JSONISH),
    "ignore_eos": st.one_of(st.booleans(), JSONISH), "logprobs": st.one_of(st.integers(-1, 21), JSONISH),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.one_of(st.booleans(), JSONISH),
    "structured_outputs": STRUCTURED, "response_format": RESPONSE_FORMAT,
    "use_beam_search": st.one_of(st.booleans(), JSONISH), "beam_width": st.one_of(st.integers(0, 20), JSONISH),
    "length_penalty": NUMBER, "early_stopping": st.one_of(st.booleans(), st.just("never"), JSONISH),
}
PARAMS = st.one_of(
    st.fixed_dictionaries({}, optional={k: v for k, v in PARAM_VALUES.items()}).map(
        lambda p: {**p, "max_tokens": p.get("max_tokens", 2)}),
    st.dictionaries(TEXT, JSONISH, max_size=2), JSONISH)
PROMPT = st.one_of(TEXT, TEXT, TEXT, st.lists(st.integers(-5, 70000), max_size=6), JSONISH, BIG_PROMPT)
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "god"]),
                                     "content": st.one_of(TEXT, JSONISH)}), max_size=3),
    JSONISH)


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(slots=True)
class Sent:
    """One frame as sent, and the id its answer must carry (None: an error with id null)."""

    text: str | bytes
    answer_id: str | None
    live_cancel: bool = False  # a cancel of a request of this batch: answered through that request's done


@st.composite
def frame(draw: st.DrawFn, index: int, live_ids: list[str]) -> Sent:
    kind = draw(st.sampled_from(["generate", "generate", "generate", "cancel", "garbage", "bad_id", "type"]))
    frame_id = f"{index}:{draw(TEXT)}"[:256]
    if kind == "generate":
        body: dict[str, Any] = {"type": "generate", "id": frame_id}
        if draw(st.booleans()):
            body["prompt"] = draw(PROMPT)
        else:
            body["messages"] = draw(MESSAGES)
        if draw(st.booleans()):
            body["params"] = draw(PARAMS)
        if draw(st.integers(0, 9)) == 0:
            body[draw(TEXT)] = draw(JSONISH)
        return _sent(body)
    if kind == "cancel":
        if live_ids and draw(st.booleans()):
            return Sent(json.dumps({"type": "cancel", "id": draw(st.sampled_from(live_ids))}), None, True)
        return _sent({"type": "cancel", "id": frame_id})
    if kind == "bad_id":
        bad = draw(st.one_of(st.just(""), st.just("i" * 257), st.integers(), st.none(), st.lists(st.integers())))
        return Sent(json.dumps({"type": "generate", "id": bad, "prompt": "Hi"}), None)
    if kind == "type":
        return _sent({"type": draw(TEXT), "id": frame_id})
    garbage = draw(st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=60).filter(lambda t: not _is_object(t)),
        st.integers(1025, 3000).map(lambda n: "[" * n + "]" * n),  # deeper than any parser allows
        st.binary(max_size=30),
        JSONISH.map(json.dumps).filter(lambda t: not _is_object(t)),
    ))
    return Sent(garbage, None)


def _sent(body: dict[str, Any]) -> Sent:
    """The frame as JSON (lone surrogates escaped, as JSON allows); its answer carries its id only if the
    server can read it: as a JSON decoder sees it (an escaped surrogate pair is one character), with no
    lone surrogate anywhere in it."""
    text = json.dumps(body)
    decoded = json.loads(text)
    frame_id = decoded.get("id")
    readable = (encodable(json.dumps(decoded, ensure_ascii=False)) and isinstance(frame_id, str)
                and 0 < len(frame_id) <= 256)
    return Sent(text, frame_id if readable else None)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


HTTP_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"]


@st.composite
def http_body(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(path, body, content type) for a POST to an OpenAI (or vLLM tokenizer) route."""
    path = draw(st.sampled_from(HTTP_PATHS))
    body: dict[str, Any] = {}
    if path == "/v1/completions":
        body["prompt"] = draw(PROMPT)
    elif path == "/v1/responses":
        body["input"] = draw(st.one_of(PROMPT, MESSAGES))
        if draw(st.booleans()):
            body["instructions"] = draw(st.one_of(TEXT, JSONISH))
    elif path == "/tokenize":
        body[draw(st.sampled_from(["prompt", "messages"]))] = draw(st.one_of(PROMPT, MESSAGES))
    else:
        body["messages"] = draw(MESSAGES)
    params = draw(PARAMS)
    if isinstance(params, dict):
        body.update(params)
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    body[limit] = draw(st.one_of(st.integers(1, 2), PARAM_VALUES["max_tokens"]))
    for key in draw(st.lists(st.sampled_from(["stream", "model", "n", "stream_options", "tools", "tool_choice", "echo",
                                              "previous_response_id", "store", "return_token_strs"]),
                             max_size=2)):
        body[key] = draw(JSONISH)
    raw = draw(st.one_of(st.just(json.dumps(body).encode()), st.binary(max_size=40),
                         st.integers(1025, 3000).map(lambda n: b"{\"a\":" * n + b"1" + b"}" * n),
                         st.just(json.dumps({**body, "pad": "p" * LIMITS["max_body_bytes"]}).encode())))
    content_type = draw(st.sampled_from(["application/json"] * 6 + ["text/plain", "application/json; charset=utf-8"]))
    return path, raw, content_type
