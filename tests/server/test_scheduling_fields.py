"""The scheduling fields alike on every route (generation.py's SCHEDULING_FIELDS and USER_FIELDS): the tier
served is echoed (completions and Responses in the body, `/v1/stream` in `start`), `cache_salt` separates
prefix caches, and where keys are off `user` / `safety_identifier` name the tenant (its metrics label). Short
requests on the session engine (tests/server/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from tests.server.test_metrics import scrape
from tests.server.util import Server, recv, running_server, send, ws_connect

MODEL = "SmolLM2-135M-Instruct"
Ask = Callable[[Server, str, dict[str, Any]], Awaitable[tuple[str, int]]]  # (tier served, cached tokens)


def fresh_prompt() -> str:
    """~120 tokens no earlier request computed (whole blocks to find again in the prefix cache)."""
    return f"{uuid.uuid4().hex}: " + " ".join(f"shelf {i} holds a red box." for i in range(20))


async def completions(srv: Server, prompt: str, fields: dict[str, Any]) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=srv.http, timeout=120) as http:
        reply = await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **fields})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["service_tier"], (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def responses(srv: Server, prompt: str, fields: dict[str, Any]) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=srv.http, timeout=120) as http:
        body = {"model": MODEL, "input": prompt, "max_output_tokens": 1, "store": False, **fields}
        reply = await http.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["service_tier"], body["usage"]["input_tokens_details"]["cached_tokens"]


async def stream(srv: Server, prompt: str, fields: dict[str, Any]) -> tuple[str, int]:
    frames = []
    async with ws_connect(srv) as ws:
        await send(ws, type="generate", id="a", prompt=prompt, params={"max_tokens": 1, **fields})
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(await recv(ws))
    start, done = frames[0], frames[-1]
    assert start["type"] == "start" and done["type"] == "done", frames
    return start["service_tier"], done["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


ROUTES: dict[str, Ask] = {"completions": completions, "responses": responses, "stream": stream}


async def test_every_route_echoes_the_tier_served(server: Server) -> None:
    for name, ask in ROUTES.items():
        tiers = [(await ask(server, "Hi", {} if tier is None else {"service_tier": tier}))[0]
                 for tier in (None, "auto", "flex", "priority")]
        assert tiers == ["default", "default", "flex", "priority"], name


async def test_a_cache_salt_separates_the_prefix_cache_on_every_route(server: Server) -> None:
    for name, ask in ROUTES.items():
        prompt, first, second = fresh_prompt(), uuid.uuid4().hex, uuid.uuid4().hex  # (salts no other test used:
        # a templated prompt's head is shared by every request of its salt on the shared engine)
        cached = [(await ask(server, prompt, {"cache_salt": salt}))[1] for salt in (first, first, second)]
        assert cached[0] == 0 and cached[1] > 64 and cached[2] == 0, (name, cached)


async def test_the_user_field_names_the_tenant_on_every_route(async_engine) -> None:
    """Keys off: `user` (or `safety_identifier`) is the tenant, shown under its configured name."""
    async with running_server(async_engine, tenants=["carol=u-carol"]) as srv:
        async with httpx.AsyncClient(base_url=srv.http, timeout=120) as http:
            before = await scrape(http)
            for ask in ROUTES.values():
                await ask(srv, "Hi", {"user": "u-carol"})
                await ask(srv, "Hi", {"safety_identifier": "u-carol"})
            after = await scrape(http)
    queued = "streamd_tenant_queue_time_seconds_count"
    carol = (("tenant", "carol"),)
    assert after[queued][carol] == before.get(queued, {}).get(carol, 0) + 2 * len(ROUTES)


async def test_a_bad_user_on_the_stream_is_refused_naming_it(server: Server) -> None:
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="a", prompt="Hi", params={"max_tokens": 1, "user": 7})
        frame = await recv(ws)
    assert frame["type"] == "error" and frame["id"] == "a", frame
    assert frame["error"]["code"] == "invalid_request" and frame["error"]["message"].startswith("user "), frame
