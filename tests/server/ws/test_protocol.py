"""Pure parts, no model: frame parsing, error bodies, auth rules, delta merging."""

from __future__ import annotations

import pytest

from streamd.engine.outputs import CompletionDelta, RequestDelta
from streamd.server.auth import Authenticator, bearer_token
from streamd.server.errors import ServiceError
from streamd.server.generation import normalize_messages
from streamd.server.ws import protocol


@pytest.mark.parametrize("text, code, frame_id", [
    ("{", "invalid_json", None),
    ("3", "invalid_json", None),
    ('{"type": "generate"}', "invalid_request", None),
    ('{"type": "generate", "id": ""}', "invalid_request", None),
    ('{"type": "generate", "id": 7, "prompt": "x"}', "invalid_request", None),
    ('{"type": "nope", "id": "a"}', "unknown_type", "a"),
    ('{"type": "generate", "id": "a"}', "invalid_request", "a"),
    ('{"type": "generate", "id": "a", "prompt": "x", "messages": []}', "invalid_request", "a"),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": []}', "invalid_request", "a"),
    ('{"type": "generate", "id": "a", "prompt": "x", "extra": 1}', "invalid_request", "a"),
])
def test_bad_frames(text: str, code: str, frame_id: str | None) -> None:
    with pytest.raises(ServiceError) as info:
        protocol.parse_frame(text)
    assert info.value.code == code and info.value.param == frame_id


def test_non_finite_literals_keep_the_frames_id() -> None:
    """Python's json writes NaN / Infinity; such a frame is read (its id kept), anything unencodable in it
    is still refused."""
    frame = protocol.parse_frame('{"type":"generate","id":"a","prompt":"hi","params":{"temperature":-Infinity}}')
    assert frame.id == "a" and frame.params["temperature"] == float("-inf")
    for text in ('{"type":"generate","id":"a","prompt":"\\ud800","params":{"temperature":NaN}}',
                 '{"type":"generate","id":"a","prompt":NaN,"x":"\\udc00"}'):
        with pytest.raises(ServiceError, match="cannot be encoded as UTF-8"):
            protocol.parse_frame(text)
    with pytest.raises(ServiceError, match="not valid JSON"):
        protocol.parse_frame('{"type":"generate","id":"a","prompt":NaN')


def test_good_frames_and_server_frames() -> None:
    frame = protocol.parse_frame('{"type":"generate","id":"a","prompt":"hi","params":{"max_tokens":3}}')
    assert frame == protocol.Generate("a", "hi", None, {"max_tokens": 3})
    assert protocol.parse_frame('{"type":"cancel","id":"a"}') == protocol.Cancel("a")
    assert protocol.delta_frame("a", 0, "é", [1], 0) == {
        "type": "delta", "id": "a", "seq": 0, "text": "é", "token_ids": [1], "index": 0}
    done = protocol.done_frame("a", "stop", {"prompt_tokens": 1}, ["stop", "length"])
    assert done == {"type": "done", "id": "a", "finish_reason": "stop", "finish_reasons": ["stop", "length"],
                    "usage": {"prompt_tokens": 1}}
    error = protocol.error_frame(None, ServiceError("overloaded", "busy"))
    assert error == {"type": "error", "id": None, "error": {"code": "overloaded", "message": "busy"}}


def test_openai_error_bodies() -> None:
    error = ServiceError("context_length_exceeded", "too long", "messages")
    assert error.status == 400
    assert error.openai_body() == {"error": {"message": "too long", "type": "invalid_request_error",
                                             "param": "messages", "code": "context_length_exceeded"}}
    assert ServiceError("unauthorized", "x").status == 401
    assert ServiceError("overloaded", "x").status == 503


def test_auth_rules() -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("Basic abc") is None
    open_auth = Authenticator([], [])
    assert open_auth.http_ok({}) and open_auth.websocket_ok({}, []) and open_auth.origin_ok(None, "h:1")
    # issue 10: with no allowlist only loopback and same-origin pages may drive the server
    for origin in ("http://localhost:3000", "http://127.0.0.1", "http://[::1]:8080", "http://srv.example:8000"):
        assert open_auth.origin_ok(origin, "srv.example:8000"), origin
    for origin in ("http://evil.example", "http://srv.example:9999", "null", "http://[bad"):
        assert not open_auth.origin_ok(origin, "srv.example:8000"), origin
    auth = Authenticator(["k1", "k2"], ["https://ok.example/"])
    assert auth.http_ok({"authorization": "Bearer k2"}) and not auth.http_ok({"authorization": "Bearer k3"})
    assert not auth.http_ok({})
    assert auth.websocket_ok({}, ["streamd.v1", "bearer.k1"]) and not auth.websocket_ok({}, ["bearer.k3"])
    assert auth.websocket_ok({"authorization": "Bearer k3"}, ["bearer.k2"])  # any offered key may match
    assert not auth.websocket_ok({"authorization": "Bearer k3"}, ["streamd.v1"])
    # the caller's key (what its resumable requests and stored responses are bound to): the offered key
    # that authenticated it, never an invalid one offered beside it
    assert auth.websocket_key({"authorization": "Bearer k3"}, ["bearer.k2"]) == "k2"
    assert auth.websocket_key({"authorization": "Bearer k1"}, ["bearer.k2"]) == "k1"
    assert auth.websocket_key({}, ["streamd.v1", "bearer.k3", "bearer.k1"]) == "k1"
    assert auth.websocket_key({"authorization": "Basic x"}, ["streamd.v1"]) is None
    assert open_auth.websocket_key({}, ["streamd.v1", "bearer.s", "bearer.t"]) == "s"
    assert auth.origin_ok("https://ok.example", None) and auth.origin_ok(None, None)
    assert not auth.origin_ok("https://evil.example", None) and not auth.origin_ok("http://localhost", None)


def test_messages_are_normalized_or_refused() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert normalize_messages(parts) == [{"role": "user", "content": "ab"}]
    for bad in ([], [{"role": "user"}], [{"role": "god", "content": "x"}],
                [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(ServiceError):
            normalize_messages(bad)


def test_deltas_merge() -> None:
    first = RequestDelta("r", 3, [CompletionDelta(0, "Hel", [1, 2], num_tokens=2)])
    first.merge(RequestDelta("r", 3, [CompletionDelta(0, "lo", [3], "stop", num_tokens=3)], finished=True))
    assert first.outputs == [CompletionDelta(0, "Hello", [1, 2, 3], "stop", num_tokens=3)]
    assert first.finished


@pytest.mark.parametrize("text, message", [
    ('{"type": "subscribe_stats", "interval_ms": 99}', "interval_ms must be an integer from 100 to 10000"),
    ('{"type": "subscribe_stats", "interval_ms": 10001}', "interval_ms must be an integer from 100 to 10000"),
    ('{"type": "subscribe_stats", "interval_ms": "500"}', "interval_ms must be an integer from 100 to 10000"),
    ('{"type": "subscribe_stats", "interval_ms": true}', "interval_ms must be an integer from 100 to 10000"),
    ('{"type": "subscribe_stats", "every": 5}', "unknown field 'every' in subscribe_stats"),
    ('{"type": "unsubscribe_stats", "interval_ms": 500}', "unknown field 'interval_ms' in unsubscribe_stats"),
])
def test_bad_stats_frames(text: str, message: str) -> None:
    with pytest.raises(ServiceError) as info:
        protocol.parse_frame(text)
    assert (info.value.code, info.value.message, info.value.param) == ("invalid_request", message, None)


def test_stats_frames_need_no_id() -> None:
    assert protocol.parse_frame('{"type": "subscribe_stats"}') == protocol.SubscribeStats(0.5)
    assert protocol.parse_frame('{"type": "subscribe_stats", "interval_ms": 100}') == protocol.SubscribeStats(0.1)
    assert protocol.parse_frame('{"type": "unsubscribe_stats"}') == protocol.UnsubscribeStats()
