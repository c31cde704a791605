"""WS /v1/stream on a real uvicorn: multiplexing, cancel, vanishing clients, bad frames, limits."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.exceptions import ConnectionClosed

from streamd import SamplingParams
from tests.server.util import Result, Server, check_stream, gather_until_done, recv, recv_frames, send, ws_connect

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


async def test_multiplexed_requests_match_llm_generate(server: Server, async_engine, smol_llm) -> None:
    params = {"max_tokens": 12, "temperature": 0.0}
    async with ws_connect(server) as ws:
        assert ws.subprotocol == "streamd.v1"
        for i, prompt in enumerate(PROMPTS):
            await send(ws, type="generate", id=f"r{i}", prompt=prompt, params=params)
        results = await gather_until_done(ws, {f"r{i}" for i in range(len(PROMPTS))})
    reference = await async_engine.call(lambda _: smol_llm.generate(PROMPTS, SamplingParams(**params)))
    for i, ref in enumerate(reference):
        result = results[f"r{i}"]
        check_stream(result)
        assert result.token_ids == ref.outputs[0].token_ids
        assert result.text == ref.outputs[0].text
        assert result.done["finish_reason"] == ref.outputs[0].finish_reason
        assert result.of("start")[0]["prompt_tokens"] == len(ref.prompt_token_ids)
        assert all(f["index"] == 0 for f in result.of("delta"))


async def test_batched_v2_and_v1_clients_get_the_same_deltas(server: Server) -> None:
    """A streamd.v2 client (every message an array of frames: each write carries whatever all its requests
    produced) and a streamd.v1 client (one frame per message) run the same seeded requests side by side."""
    params = {"max_tokens": 24, "temperature": 0.9, "seed": 11, "logprobs": 1}
    ids = {f"s{i}" for i in range(len(PROMPTS))}
    messages: list[int] = []

    async def run(subprotocol: str) -> dict[str, Result]:
        async with ws_connect(server, subprotocols=[subprotocol]) as ws:
            assert ws.subprotocol == subprotocol
            for i, prompt in enumerate(PROMPTS):
                await send(ws, type="generate", id=f"s{i}", prompt=prompt, params=params)
            results: dict[str, Result] = {}
            pending = set(ids)
            while pending:
                frames = await recv_frames(ws)
                messages.append(len(frames)) if subprotocol == "streamd.v2" else None
                for frame in frames:
                    results.setdefault(frame["id"], Result()).frames.append(frame)
                    pending.discard(frame["id"]) if frame["type"] == "done" else None
            return results

    v2, v1 = await asyncio.gather(run("streamd.v2"), run("streamd.v1"))
    for request_id in ids:
        check_stream(v1[request_id])
        check_stream(v2[request_id])
        assert v2[request_id].token_ids == v1[request_id].token_ids and len(v1[request_id].token_ids) == 24
        assert v2[request_id].text == v1[request_id].text
        assert v2[request_id].done == v1[request_id].done
        logprobs = [lp for f in v2[request_id].of("delta") for lp in f["logprobs"]]
        assert len(logprobs) == 24
    assert max(messages) > 1, "v2 never carried several frames in one message"


async def test_messages_use_the_models_chat_template(server: Server, smol_llm) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="m", messages=messages, params={"max_tokens": 4, "temperature": 0})
        result = (await gather_until_done(ws, {"m"}))["m"]
    check_stream(result)
    assert result.of("start")[0]["prompt_tokens"] == len(smol_llm.engine.apply_chat_template(messages))


async def test_cancel_mid_stream_ends_with_cancelled(server: Server) -> None:
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="long", prompt="Tell me a long story.",
                   params={"max_tokens": 400, "ignore_eos": True, "temperature": 0})
        frames = [await recv(ws), await recv(ws)]
        assert [f["type"] for f in frames] == ["start", "delta"]
        await send(ws, type="cancel", id="long")
        result = (await gather_until_done(ws, {"long"}))["long"]
    assert result.done["finish_reason"] == "cancelled"
    assert result.done["usage"]["completion_tokens"] < 400
    # the autouse fixture then checks that the pool is whole again


async def test_client_that_vanishes_frees_its_blocks(server: Server, async_engine) -> None:
    cancelled = server.services.metrics.requests.labels("cancelled")
    before = cancelled._value.get()
    ws = await ws_connect(server)
    await send(ws, type="generate", id="gone", prompt="Write an essay.",
               params={"max_tokens": 2000, "ignore_eos": True})
    assert (await recv(ws))["type"] == "start"
    assert (await recv(ws))["type"] == "delta"
    ws.transport.abort()  # no close frame: the client just disappears
    stats = await async_engine.wait_idle(timeout=60)
    assert stats.kv.blocks_free == stats.kv.blocks_total
    assert cancelled._value.get() == before + 1


async def test_bad_frames_get_errors_while_other_streams_continue(server: Server) -> None:
    bad = [
        ("not json", None, "invalid_json"),
        ("[1, 2]", None, "invalid_json"),
        (json.dumps({"type": "generate", "prompt": "x"}), None, "invalid_request"),
        (json.dumps({"type": "bogus", "id": "b1"}), "b1", "unknown_type"),
        (json.dumps({"type": "generate", "id": "b2", "prompt": "x", "params": {"temperature": -1}}), "b2",
         "invalid_request"),
        (json.dumps({"type": "generate", "id": "b3", "prompt": "x", "params": {"bogus": 1}}), "b3",
         "invalid_request"),
        (json.dumps({"type": "generate", "id": "b4", "prompt": "x", "messages": []}), "b4", "invalid_request"),
        (json.dumps({"type": "generate", "id": "b5", "messages": [{"role": "wizard", "content": "x"}]}), "b5",
         "invalid_request"),
        (json.dumps({"type": "generate", "id": "ok", "prompt": "again"}), "ok", "duplicate_id"),
        (json.dumps({"type": "cancel", "id": "nobody"}), "nobody", "unknown_id"),
        (json.dumps({"type": "generate", "id": "b6", "prompt": "x", "params": {"n": 17}}), "b6", "invalid_request"),
        (json.dumps({"type": "generate", "id": "b7", "prompt": [10 ** 9]}), "b7", "invalid_request"),
    ]
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="ok", prompt="Count: one, two,",
                   params={"max_tokens": 24, "ignore_eos": True, "temperature": 0})
        start = await recv(ws)
        assert start["type"] == "start"
        stray: list[dict] = []
        for text, _, _ in bad:
            await ws.send(text)
        await ws.send(b"\x00binary")
        results = await gather_until_done(ws, {"ok"}, {"ok": Result([start])}, stray=stray)
        while len(stray) < len(bad):  # errors may still be behind the done
            stray.append(await recv(ws))
        # the socket is still usable afterwards
        await send(ws, type="generate", id="after", prompt="Hi", params={"max_tokens": 2})
        after = (await gather_until_done(ws, {"after"}))["after"]
    check_stream(results["ok"])
    assert results["ok"].done["finish_reason"] == "length"
    assert len(results["ok"].token_ids) == 24
    errors = [(f["id"], f["error"]["code"]) for f in stray + results["ok"].of("error")]
    assert all(f["type"] == "error" for f in stray), stray
    assert sorted(errors, key=str) == sorted([(i, c) for _, i, c in bad] + [(None, "invalid_request")], key=str)
    check_stream(after)


async def test_oversize_frame_closes_with_1009(server: Server) -> None:
    async with ws_connect(server, max_size=None) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "big", "prompt": "x" * 70_000}))
        with pytest.raises(ConnectionClosed) as info:
            await recv(ws)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009


async def test_context_and_max_tokens_limits(server: Server, async_engine) -> None:
    context = async_engine.max_model_len
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="long", prompt=[42] * context)
        await send(ws, type="generate", id="room", prompt="Hello", params={"max_tokens": context})
        frames = [await recv(ws), await recv(ws)]
    codes = {f["id"]: f["error"]["code"] for f in frames}
    assert codes == {"long": "context_length_exceeded", "room": "context_length_exceeded"}


async def test_requests_per_connection_limit(server: Server) -> None:
    limit = server.services.config.max_requests_per_connection
    async with ws_connect(server) as ws:
        for i in range(limit):
            await send(ws, type="generate", id=f"r{i}", prompt="Go on:",
                       params={"max_tokens": 1000, "ignore_eos": True})
        await send(ws, type="generate", id="over", prompt="Go on:")
        stray: list[dict] = []
        while not any(f.get("id") == "over" for f in stray):
            stray.append(await recv(ws))
        over = next(f for f in stray if f.get("id") == "over")
        assert over["type"] == "error" and over["error"]["code"] == "too_many_requests"
        for i in range(limit):
            await send(ws, type="cancel", id=f"r{i}")
        results = await gather_until_done(ws, {f"r{i}" for i in range(limit)})
    assert {r.done["finish_reason"] for r in results.values()} == {"cancelled"}


async def test_cancel_before_admission_and_task_cancel(server: Server, async_engine) -> None:
    """A cancel sent right behind its generate still yields exactly one done."""
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="quick", prompt="Hi", params={"max_tokens": 500, "ignore_eos": True})
        await send(ws, type="cancel", id="quick")
        result = (await gather_until_done(ws, {"quick"}))["quick"]
    assert result.done["finish_reason"] == "cancelled"
    await asyncio.wait_for(async_engine.wait_idle(), 60)
