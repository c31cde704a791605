"""streamd's `streamd_background: true` on streamed chat completions and completions (issue 32): every SSE
event carries `id: N`; a stream cut after some events resumes with `GET .../{id}?starting_after=N` (or the
`Last-Event-ID` header) to exactly the uninterrupted run's content; cancel answers it cancelled (KV blocks
freed: the autouse idle check); another key's lookups answer 404."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import Server, running_server

MESSAGES = [{"role": "user", "content": "Name three colours and say why you like them."}]


async def _events(answer: httpx.Response) -> list[tuple[int | None, Any]]:
    """(SSE id, data) of each event ('[DONE]' as a string)."""
    out, event_id = [], None
    async for line in answer.aiter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            data = line[6:]
            out.append((event_id, data if data == "[DONE]" else orjson.loads(data)))
            event_id = None
    return out


def _content(events: list[tuple[int | None, Any]]) -> str:
    return "".join((d["choices"][0]["delta"].get("content") or "") for _, d in events
                   if isinstance(d, dict) and d["choices"])


@pytest.mark.parametrize("resume_by", ["query", "header"])
async def test_a_cut_chat_stream_resumes_exactly(server: Server, resume_by: str) -> None:
    body = {"model": server.services.model_name, "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
            "stream": True}
    async with httpx.AsyncClient(base_url=server.http, timeout=120) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            whole = await _events(answer)
        first: list[tuple[int | None, Any]] = []
        async with http.stream("POST", "/v1/chat/completions", json={**body, "streamd_background": True}) as answer:
            event_id = None
            async for line in answer.aiter_lines():
                if line.startswith("id: "):
                    event_id = int(line[4:])
                elif line.startswith("data: "):
                    first.append((event_id, orjson.loads(line[6:])))
                if len(first) == 4:
                    break
        assert [i for i, _ in first] == [0, 1, 2, 3]  # the live stream numbers its events too
        call_id, last = first[0][1]["id"], len(first) - 1
        query, headers = ({"starting_after": last}, {}) if resume_by == "query" else ({}, {"Last-Event-ID": str(last)})
        async with http.stream("GET", f"/v1/chat/completions/{call_id}", params=query, headers=headers) as answer:
            assert answer.status_code == 200
            rest = await _events(answer)
    assert [i for i, _ in rest] == list(range(len(first), len(first) + len(rest)))
    events = first + rest
    assert _content(events) == _content(whole) and events[-1][1] == "[DONE]"
    finish = [d["choices"][0]["finish_reason"] for _, d in events if isinstance(d, dict) and d["choices"]]
    assert finish[-1] == [d["choices"][0]["finish_reason"] for _, d in whole if isinstance(d, dict)][-1]


async def test_cancel_delete_and_the_key(async_engine: AsyncEngine) -> None:
    async with running_server(async_engine, api_keys=["key-a", "key-b"]) as srv:
        body = {"model": srv.services.model_name, "prompt": "Once upon a time", "max_tokens": 2000,
                "temperature": 0, "stream": True, "streamd_background": True}
        mine, theirs = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
        async with httpx.AsyncClient(base_url=srv.http, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json=body, headers=mine) as answer:
                async for line in answer.aiter_lines():
                    if line.startswith("data: "):
                        call_id = orjson.loads(line[6:])["id"]
                        break
            for method, path in (("GET", ""), ("POST", "/cancel"), ("DELETE", "")):
                other = await http.request(method, f"/v1/completions/{call_id}{path}", headers=theirs)
                assert other.status_code == 404, other.text
            cancelled = await http.post(f"/v1/completions/{call_id}/cancel", headers=mine)
            assert cancelled.json()["status"] == "cancelled"
            assert (await http.delete(f"/v1/completions/{call_id}", headers=mine)).json()["deleted"] is True
            assert (await http.get(f"/v1/completions/{call_id}", headers=mine)).status_code == 404
            refused = await http.post("/v1/completions", json={**body, "stream": False}, headers=mine)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "streamd_background"
