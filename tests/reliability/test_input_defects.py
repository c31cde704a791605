"""Issue 35's input defects, each on a live server driven by real clients: numbers too large for a float
field (D11), the Host allowlist against DNS rebinding (D12), the grammar compile budget, gate and cache
(D2, D3). Every test ends with the engine idle and its KV pool whole (fixtures)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from streamd.config import GrammarConfig
from streamd.engine import SamplingParams, StructuredOutputs
from streamd.engine.client.async_engine import AsyncEngine
from streamd.server.compile_gate import CompileGate
from streamd.server.errors import ServiceError
from tests.reliability.test_reproductions import error_for
from tests.reliability.util import settle
from tests.server.util import Server, gather_until_done, running_server, send, ws_connect

HUGE = "1" + "0" * 400  # a JSON number no double holds: Python's json reads it as an int
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "timeout_s"]


@pytest.mark.parametrize("name", [*FLOAT_FIELDS, "length_penalty"])
async def test_a_400_digit_number_in_a_float_field_is_refused_naming_it(rserver: Server, name: str) -> None:
    beams = ', "use_beam_search": true, "n": 2' if name == "length_penalty" else ""
    body = f'{{"prompt": "Hi", "max_tokens": 2, "{name}": {HUGE}{beams}}}'
    async with httpx.AsyncClient(base_url=rserver.http, timeout=120) as http:
        answer = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == name and "digits" in answer.json()["error"]["message"]
    async with ws_connect(rserver) as ws:
        frame = f'{{"type": "generate", "id": "big", "prompt": "Hi", "params": {{"max_tokens": 2, "{name}": {HUGE}{beams}}}}}'
        error = await error_for(ws, frame)
        assert error["id"] == "big" and error["error"]["code"] == "invalid_request", error
        assert error["error"]["message"].startswith(name), error
        await send(ws, type="generate", id="after", prompt="Hi", params={"max_tokens": 2})
        assert (await gather_until_done(ws, {"after"}))["after"].done["finish_reason"] == "length"


async def _handshake_status(server: Server, host: str, origin: str) -> int:
    """The status line of a raw WebSocket handshake that names `host` (real clients set Host themselves)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write((f"GET /v1/stream HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\nUpgrade: websocket\r\n"
                  "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: streamd.v1\r\n\r\n").encode())
    status = int((await asyncio.wait_for(reader.readline(), 60)).split()[1])
    writer.close()
    await writer.wait_closed()
    return status


async def _post_as(server: Server, host: str, origin: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.http, timeout=120) as http:
        return await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                               headers={"host": host, "origin": origin})


async def test_dns_rebinding_hosts_are_refused_without_api_keys(rserver: Server) -> None:
    """A page on attacker.example rebound to 127.0.0.1 is same-origin with itself: its Host is refused."""
    evil = f"attacker.example:{rserver.port}"
    answer = await _post_as(rserver, evil, f"http://{evil}")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_host", answer.text
    assert "attacker.example" in answer.json()["error"]["message"]
    async with httpx.AsyncClient(base_url=rserver.http, timeout=120) as http:
        assert (await http.get("/v1/models", headers={"host": evil})).status_code == 400
        assert (await http.get("/health", headers={"host": evil})).status_code == 200  # probes by pod address
    assert await _handshake_status(rserver, evil, f"http://{evil}") == 400
    for good in (f"127.0.0.1:{rserver.port}", f"localhost:{rserver.port}"):  # loopback pages stay same-origin
        assert (await _post_as(rserver, good, f"http://{good}")).status_code == 200
        assert await _handshake_status(rserver, good, f"http://{good}") == 101


async def test_configured_hosts_are_served_and_same_origin(async_engine: AsyncEngine) -> None:
    async with running_server(async_engine, allowed_hosts=["chat.example"]) as srv:
        named, evil = f"chat.example:{srv.port}", f"attacker.example:{srv.port}"
        assert (await _post_as(srv, named, f"http://{named}")).status_code == 200
        assert await _handshake_status(srv, named, f"http://{named}") == 101
        assert (await _post_as(srv, evil, f"http://{evil}")).status_code == 400
        await settle(srv)
    async with running_server(async_engine, allowed_hosts=["*"]) as srv:
        evil = f"attacker.example:{srv.port}"
        assert (await _post_as(srv, evil, f"http://{evil}")).status_code == 200
        await settle(srv)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def roomy(async_engine: AsyncEngine) -> AsyncIterator[Server]:
    """A server whose frames and bodies take the megabyte-sized specs of issue 35."""
    async with running_server(async_engine, max_frame_bytes=4 << 20, max_body_bytes=8 << 20) as srv:
        yield srv


def _properties(n: int, prefix: str = "p") -> dict[str, Any]:
    """An object of n optional integer properties: a few dozen bytes each to send, steep to compile."""
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(n)}}


def _chat(schema: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.mark.parametrize(("spec", "limit"), [
    ({"json": _properties(2000)}, "grammar.max_properties"),
    ({"json": {"type": "string", "minLength": 5000}}, "grammar.max_repeat"),
    ({"regex": "[a-z]{100000}"}, "grammar.max_repeat"),
    ({"choice": [f"c{i}" for i in range(5000)]}, "grammar.max_alternatives"),
    ({"json": {"enum": list(range(5000))}}, "grammar.max_alternatives"),
    ({"grammar": 'root ::= "' + "a" * 70000 + '"'}, "grammar.max_chars"),
])
async def test_specs_over_the_compile_budget_are_refused_naming_the_limit(
        roomy: Server, spec: dict[str, Any], limit: str) -> None:
    """Each of these took seconds to minutes of compile CPU (issue 35 D2); now refused before compiling."""
    async with ws_connect(roomy, max_size=None) as ws:
        error = await error_for(ws, json.dumps({"type": "generate", "id": "big", "prompt": "Hi",
                                                "params": {"structured_outputs": spec, "max_tokens": 2}}))
        assert error["id"] == "big" and limit in error["error"]["message"], error
        assert "too complex" in error["error"]["message"], error


async def test_heavy_compiles_are_bounded_and_light_ones_never_wait(rserver: Server) -> None:
    """With the key-less clients' compile slots taken, a heavy schema gets 503 + Retry-After at once; a
    light one is served; once the slots are back the heavy one compiles."""
    gate = rserver.services.generation.compiles
    heavy = SamplingParams(structured_outputs=StructuredOutputs(json=_properties(300, "held")))
    held = [gate.enter(heavy, None) for _ in range(gate.config.max_concurrent_compiles_per_key)]
    async with httpx.AsyncClient(base_url=rserver.http, timeout=120) as http:
        try:
            busy = await http.post("/v1/chat/completions", json=_chat(_properties(300, "a")))
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
            assert "max_concurrent_compiles_per_key" in busy.json()["error"]["message"]
            light = await http.post("/v1/chat/completions", json=_chat(_properties(3, "b")))
            assert light.status_code == 200, light.text
            over = await http.post("/v1/chat/completions", json=_chat(_properties(2000, "c")))
            assert over.status_code == 400 and "grammar.max_properties" in over.text, over.text  # never a 503
        finally:
            for tenant in held:
                gate.leave(tenant, None)
        assert gate.in_flight == 0
        again = await http.post("/v1/chat/completions", json=_chat(_properties(300, "a")))
        assert again.status_code == 200, again.text
    assert gate.in_flight == 0


async def test_a_compile_slot_is_held_until_the_compile_ends_even_when_its_client_left() -> None:
    gate = CompileGate(GrammarConfig(max_concurrent_compiles_per_key=1))
    heavy = SamplingParams(structured_outputs=StructuredOutputs(json=_properties(300)))
    release = asyncio.Event()
    slot = gate.enter(heavy, "k")
    compiling = gate.start(release.wait())
    waiter = asyncio.ensure_future(gate.wait(compiling))
    await asyncio.sleep(0)  # (one loop turn: the waiter is waiting)
    waiter.cancel()
    gate.leave(slot, compiling)
    assert gate.in_flight == 1  # the client left; its compile goes on, and holds the slot
    with pytest.raises(ServiceError, match="max_concurrent_compiles_per_key"):
        gate.enter(heavy, "k")
    assert gate.enter(heavy, "other") == "other"  # another key has its own slots
    release.set()
    await compiling
    await asyncio.sleep(0)  # (the done callbacks run on the next loop turn)
    assert gate.in_flight == 1 and gate.enter(heavy, "k") == "k"


async def test_the_grammar_cache_is_bounded_and_exported(rserver: Server) -> None:
    async with httpx.AsyncClient(base_url=rserver.http, timeout=120) as http:
        for i in range(3):
            answer = await http.post("/v1/chat/completions", json=_chat(_properties(3, f"cache{i}_")))
            assert answer.status_code == 200, answer.text
        metrics = (await http.get("/metrics")).text
    cached = [line for line in metrics.splitlines() if line.startswith("streamd_grammar_cache_bytes ")]
    assert cached and float(cached[0].split()[1]) > 0, cached
    compiler = rserver.services.engine.engine.grammars.compiler  # type: ignore[attr-defined]
    assert compiler._compiler.cache_limit_bytes == GrammarConfig().cache_bytes
