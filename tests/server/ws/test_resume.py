"""Streams that survive the network (issue 12) on a real server and real sockets: resume after a TCP cut,
refused resumes, deadlines. (Slow readers: test_slow_reader.py; SIGTERM: test_sigterm.py.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from openai import APIStatusError, AsyncOpenAI

from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import Result, Server, check_stream, gather_until_done, recv, running_server, send, ws_connect


async def metrics_text(server: Server, headers: dict[str, str] | None = None) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{server.http}/metrics", headers=headers)).text


SEEDED = {"max_tokens": 32, "temperature": 0.9, "seed": 1234, "ignore_eos": True}
RECONNECT_DELAY_S = 2.0  # the scenario: a phone that changed networks


async def ack(ws: Any, result: Result) -> None:
    """Tells the server a finished request's done arrived (else it stays resumable for the grace)."""
    (start,) = result.of("start")[:1]
    await send(ws, type="ack", id=start["id"], resume_token=start["resume_token"])


async def released(server: Server) -> None:
    """Waits (polling, with a deadline) until the resume store holds nothing."""
    resumes, deadline = server.services.resumes, time.monotonic() + 30
    while len(resumes) or resumes.total_tokens:
        assert time.monotonic() < deadline, (len(resumes), resumes.total_tokens)
        await asyncio.sleep(0.01)


async def reference(server: Server, params: dict[str, Any], prompt: str = "Tell me a story") -> Result:
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="ref", prompt=prompt, params=params)
        result = (await gather_until_done(ws, {"ref"}))["ref"]
        await ack(ws, result)
    check_stream(result)
    return result


async def start_and_cut(server: Server, params: dict[str, Any], deltas: int,
                        **connect: Any) -> tuple[list[dict[str, Any]], str]:
    """Starts a request, reads its start and `deltas` deltas, then cuts the TCP connection with no close
    handshake; returns the frames read and the resume token."""
    frames: list[dict[str, Any]] = []
    ws = await ws_connect(server, **connect)
    await send(ws, type="generate", id="r", prompt="Tell me a story", params=params)
    while sum(f["type"] == "delta" for f in frames) < deltas:
        frames.append(await recv(ws))
    ws.transport.abort()  # RST, no close frame
    start = frames[0]
    assert start["type"] == "start" and isinstance(start["resume_token"], str)
    return frames, start["resume_token"]


async def cut_and_resume(server: Server) -> tuple[list[dict[str, Any]], Result]:
    before, token = await start_and_cut(server, SEEDED, deltas=10)
    await asyncio.sleep(RECONNECT_DELAY_S)  # the scenario's reconnect delay, not synchronisation
    async with ws_connect(server) as ws:
        await send(ws, type="resume", id="r", resume_token=token, after_seq=9)
        after = (await gather_until_done(ws, {"r"}))["r"]
        await ack(ws, Result(before[:1]))
        return before, after


async def test_resume_after_tcp_cut_equals_uninterrupted_run(async_engine: AsyncEngine) -> None:
    async with running_server(async_engine) as server:
        expected, (before, after) = await asyncio.gather(reference(server, SEEDED), cut_and_resume(server))
        result = Result(before + after.frames)
        check_stream(result)  # seq 0.. without gap or repeat, one done, usage adds up
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text
        assert result.done["finish_reason"] == "length"
        metrics = await metrics_text(server)
        assert 'streamd_resumes_total{outcome="resumed"} 1.0' in metrics
        await released(server)  # (acknowledged)


async def test_refused_resumes_name_the_reason(async_engine: AsyncEngine) -> None:
    keys = {"k1": {"Authorization": "Bearer k1"}, "k2": {"Authorization": "Bearer k2"}}
    long = {"max_tokens": 400, "ignore_eos": True}
    async with running_server(async_engine, api_keys=["k1", "k2"], resume_grace_s=1.0) as server:
        async with ws_connect(server, additional_headers=keys["k1"]) as ws:  # a finished, delivered request
            await send(ws, type="generate", id="done", prompt="Hi", params={"max_tokens": 2})
            finished = (await gather_until_done(ws, {"done"}))["done"]
            await ack(ws, finished)  # acknowledged: nothing kept for a resume
        stale = finished.of("start")[0]["resume_token"]
        _, token = await start_and_cut(server, long, deltas=2, additional_headers=keys["k1"])
        attempts = [("k2", "r", token, 0, "resume_forbidden"),
                    ("k1", "r", token[:-4] + "abcd", 0, "invalid_resume_token"),
                    ("k1", "other", token, 0, "invalid_resume_token"),
                    ("k1", "r", token, 10_000, "invalid_request"),
                    ("k1", "done", stale, 0, "unknown_id")]
        for key, rid, tok, after, code in attempts:
            async with ws_connect(server, additional_headers=keys[key]) as ws:
                await send(ws, type="resume", id=rid, resume_token=tok, after_seq=after)
                frame = await recv(ws)
                assert frame["type"] == "error" and frame["error"]["code"] == code, (code, frame)
                assert frame["id"] == rid and frame["error"]["message"]
        async with ws_connect(server, additional_headers=keys["k1"]) as ws:  # its id is live on this socket
            await send(ws, type="generate", id="r", prompt="Hi", params=long)
            await send(ws, type="resume", id="r", resume_token=token, after_seq=0)
            await send(ws, type="cancel", id="r")
            live = (await gather_until_done(ws, {"r"}))["r"]
            await ack(ws, live)
        assert [f["error"]["code"] for f in live.of("error")] == ["duplicate_id"]
        assert live.done["finish_reason"] == "cancelled"  # the live request, not the detached one
        stats = await async_engine.wait_idle()  # the grace ends: the request is aborted, its blocks freed
        assert stats.pool_whole
        async with ws_connect(server, additional_headers=keys["k1"]) as ws:
            await send(ws, type="resume", id="r", resume_token=token, after_seq=0)
            frame = await recv(ws)
        assert frame["error"]["code"] == "resume_expired" and "grace" in frame["error"]["message"]
        await released(server)
        metrics = await metrics_text(server, keys["k1"])
        assert 'streamd_resumes_total{outcome="expired"} 1.0' in metrics
        assert 'streamd_requests_total{finish_reason="cancelled"}' in metrics


async def test_retention_bounds(async_engine: AsyncEngine) -> None:
    """Attached, a request keeps only its newest frames (a resume from before them is refused, not
    answered with a gap); detached, one that passes its bound is aborted and a resume hears why."""
    async with running_server(async_engine, resume_max_tokens_per_request=8) as server:
        async with ws_connect(server) as ws:
            await send(ws, type="generate", id="big", prompt="Hi", params={"max_tokens": 20, "ignore_eos": True})
            result = (await gather_until_done(ws, {"big"}))["big"]
            await ack(ws, result)
        check_stream(result)
        assert not result.of("error") and len(result.token_ids) == 20
        _, token = await start_and_cut(server, {"max_tokens": 400, "ignore_eos": True}, deltas=12)
        async with ws_connect(server) as ws:
            await send(ws, type="resume", id="r", resume_token=token, after_seq=0)
            early = await recv(ws)
            stats = await async_engine.wait_idle()  # detached, it passes its bound and is aborted
            assert stats.pool_whole
            await send(ws, type="resume", id="r", resume_token=token, after_seq=11)
            late = await recv(ws)
        await released(server)
    assert early["error"]["code"] == "resume_expired"  # (its frames before the window, or the whole request)
    assert late["error"]["code"] == "resume_expired"
    assert "resume_max_tokens_per_request" in late["error"]["message"]


async def test_run_timeout_delivers_partial_output(async_engine: AsyncEngine) -> None:
    """server.max_request_time_s caps a request's timeout_s and is the default of those without one."""
    params = {"max_tokens": 2000, "ignore_eos": True, "timeout_s": 50.0}
    # 2 s, not 1: on a loaded box one full-suite run saw a chat's first token come after 1 s (0 tokens)
    async with running_server(async_engine, max_request_time_s=2.0) as server:
        async with ws_connect(server) as ws:
            await send(ws, type="generate", id="t", prompt="Hi", params=params)
            result = (await gather_until_done(ws, {"t"}))["t"]
        check_stream(result)
        assert result.done["finish_reason"] == "timeout" and 0 < len(result.token_ids) < 2000
        client = AsyncOpenAI(base_url=f"{server.http}/v1", api_key="x")
        body = {"model": server.services.model_name, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2000, "extra_body": {"ignore_eos": True}}
        reply = await client.chat.completions.create(**body)
        choice = reply.choices[0]
        assert choice.finish_reason == "length" and choice.model_extra["streamd_timeout"] is True
        assert 0 < reply.usage.completion_tokens < 2000 and choice.message.content
        chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
        last = chunks[-1].choices[0]
        assert last.finish_reason == "length" and last.model_extra["streamd_timeout"] is True
        metrics = await metrics_text(server)
        assert 'streamd_requests_total{finish_reason="timeout"} 3.0' in metrics


async def test_queue_timeout_is_overloaded(async_engine: AsyncEngine) -> None:
    """With one sequence slot, a second request waits; past max_queue_time_s it is refused."""
    hold = await async_engine.call(lambda e: e.scheduler.max_num_seqs)
    await async_engine.call(lambda e: setattr(e.scheduler, "max_num_seqs", 1))
    try:
        async with running_server(async_engine, max_queue_time_s=0.5) as server, ws_connect(server) as ws:
            await send(ws, type="generate", id="busy", prompt="Hi",
                       params={"max_tokens": 400, "ignore_eos": True})
            assert (await recv(ws))["type"] == "start"
            await send(ws, type="generate", id="late", prompt="Hi", params={"max_tokens": 4})
            late = (await gather_until_done(ws, {"late"}))["late"]
            (error,) = late.of("error")
            assert error["error"]["code"] == "overloaded" and late.done["finish_reason"] == "timeout"
            assert "server.max_queue_time_s" in error["error"]["message"]
            assert late.token_ids == []
            client = AsyncOpenAI(base_url=f"{server.http}/v1", api_key="x", max_retries=0)
            for stream in (False, True):
                try:
                    await client.completions.create(model=server.services.model_name, prompt="Hi",
                                                    max_tokens=4, stream=stream)
                    raise AssertionError("not refused")
                except APIStatusError as exc:
                    assert exc.status_code == 503 and exc.body["code"] == "overloaded", exc.body
                    assert exc.body["message"] == error["error"]["message"]  # one refusal on every route
            await send(ws, type="cancel", id="busy")
            await gather_until_done(ws, {"busy"})
    finally:
        await async_engine.call(lambda e: setattr(e.scheduler, "max_num_seqs", hold))


class CuttingProxy:
    """A TCP proxy to the server that cuts its first connection (no close handshake, either side) once
    `cut_after` bytes came from the server; later connections pass untouched."""

    def __init__(self, port: int, cut_after: int) -> None:
        self.port = port
        self.cut_after = cut_after
        self.cuts = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> CuttingProxy:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/stream"

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.port)
        cut = self.cuts == 0
        limit = self.cut_after if cut else None
        await asyncio.gather(self._pipe(client_r, server_w, None, client_w),
                             self._pipe(server_r, client_w, limit, server_w), return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, limit: int | None,
                    other: asyncio.StreamWriter) -> None:
        sent = 0
        while data := await src.read(65536):
            if limit is not None and sent + len(data) > limit:
                self.cuts += 1
                dst.transport.abort()
                other.transport.abort()
                return
            dst.write(data)
            sent += len(data)
            await dst.drain()
        dst.close()


async def test_chat_cli_resumes_after_a_dropped_connection(async_engine: AsyncEngine, capsys: Any) -> None:
    import argparse

    from streamd.cli.chat import _chat, add_chat_arguments

    parser = argparse.ArgumentParser()
    add_chat_arguments(parser)
    async with running_server(async_engine) as server, CuttingProxy(server.port, cut_after=1200) as proxy:
        args = parser.parse_args(["--url", proxy.url, "--prompt", "Name three colours.", "--max-tokens", "24",
                                  "--temperature", "0"])
        assert await _chat(args) == 0
        out, err = capsys.readouterr()
        async with ws_connect(server) as ws:
            await send(ws, type="generate", id="ref", messages=[{"role": "user", "content": "Name three colours."}],
                       params={"max_tokens": 24, "temperature": 0})
            expected = (await gather_until_done(ws, {"ref"}))["ref"]
    assert proxy.cuts == 1 and "[reconnecting" in err
    assert out.strip() == expected.text.strip() and expected.text.strip()


async def test_drain_cancels_requests_whose_client_is_gone(async_engine: AsyncEngine) -> None:
    """No socket can resume while the server drains, so a detached request does not hold the drain up."""
    async with running_server(async_engine, drain_timeout_s=300) as server:
        await start_and_cut(server, {"max_tokens": 2000, "ignore_eos": True}, deltas=2)
        async with asyncio.timeout(60):  # far less than drain_timeout_s
            await server.services.lifecycle.drain()
        assert len(server.services.resumes) == 0
        assert 'streamd_requests_total{finish_reason="cancelled"} 1.0' in await metrics_text(server)
