"""Protocol fuzzers against a live server: WebSocket frames and OpenAI HTTP bodies drawn by hypothesis
from the full Unicode range (lone surrogates included) and at and over every limit.

WebSocket: every frame is answered (each readable id gets exactly one `done` or its `error`; every frame
whose id cannot be read gets one `error` with id null), the socket stays open, a control stream on the
same socket and a control client on another socket get exactly the reference tokens, and the pool is whole
at the end (fixture). HTTP (completions, chat, responses, /tokenize): every body gets a JSON answer (or a
whole SSE stream), never a 500. At least `FRAMES` frames and `HTTP_BODIES` bodies per full run (slow: `make
test-all`, ten times more in `make soak`); the light run of `make test` sends 200 frames and 30 bodies. A fresh
seed each run (`STREAMD_FUZZ_SEED` replays one; the seed is printed on failure).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from websockets.sync.client import ClientConnection, connect

from tests.helpers import sizes
from tests.reliability.fuzz_frames import Sent, frame, http_body
from tests.reliability.test_reproductions import CONTROL, reference_tokens
from tests.server.util import Server, gather_until_done, send, ws_connect

BATCH = 20
CONTROL_EVERY = 10  # examples between control streams on the fuzzed socket itself
FRAMES = int(os.environ.get("STREAMD_FUZZ_FRAMES", "2000"))
HTTP_BODIES = int(os.environ.get("STREAMD_FUZZ_HTTP", "300"))
SEED = int(os.environ.get("STREAMD_FUZZ_SEED", random.SystemRandom().randrange(2**32)))
TIMEOUT = 60.0  # per read; a batch of 20 small frames is answered in well under a second
FUZZ = settings(max_examples=max(1, FRAMES // BATCH), deadline=None, database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


def _seeded(test: Any) -> Any:
    def run(*args: Any) -> None:
        try:
            test(*args)
        except BaseException:
            print(f"\nfuzz failed: replay with STREAMD_FUZZ_SEED={SEED}")
            raise
    return run


@st.composite
def batch(draw: st.DrawFn) -> list[Sent]:
    sent: list[Sent] = []
    for i in range(BATCH):
        live = [s.answer_id for s in sent if s.answer_id is not None and not s.live_cancel]
        sent.append(draw(frame(i, live)))
    return sent


def _frames(ws: ClientConnection) -> list[dict[str, Any]]:
    message = json.loads(ws.recv(timeout=TIMEOUT))
    return message if isinstance(message, list) else [message]


def check_batch(ws: ClientConnection, sent: list[Sent]) -> None:
    """Sends the batch and reads until every frame is answered."""
    expected = {s.answer_id for s in sent if s.answer_id is not None}
    assert len(expected) == len([s for s in sent if s.answer_id is not None]), "ids are unique by construction"
    nulls = sum(1 for s in sent if s.answer_id is None and not s.live_cancel)
    cancelled = {json.loads(s.text)["id"] for s in sent if s.live_cancel}
    for s in sent:
        ws.send(s.text)
    started: set[str] = set()
    answered: dict[str, str] = {}
    got_nulls = 0
    while set(answered) != expected or got_nulls < nulls:
        try:
            frames = _frames(ws)
        except TimeoutError:
            unanswered = [s.text for s in sent if s.answer_id in expected - set(answered)]
            raise AssertionError(f"no answer in {TIMEOUT:.0f} s to {unanswered} (id-null errors: {got_nulls} "
                                 f"of {nulls})") from None
        for f in frames:
            fid = f.get("id")
            if f["type"] == "error" and fid is None:
                got_nulls += 1
            elif f["type"] == "start":
                started.add(fid)
            elif f["type"] == "done":
                assert fid not in answered or answered[fid] == "error", f"two answers for {fid!r}"
                answered[fid] = "done"
            elif f["type"] == "error" and fid not in started:
                if fid in answered and fid in cancelled and f["error"]["code"] == "unknown_id":
                    continue  # a cancel of a request of this batch that had already ended
                assert fid in expected or fid in cancelled, f"error for an id never sent: {f}"
                assert fid not in answered, f"two answers for {fid!r}: {f}"
                answered[fid] = "error"
            else:
                assert f["type"] in ("delta", "error", "progress"), f
    assert got_nulls == nulls


@pytest.mark.parametrize("frames", sizes(200, FRAMES))
async def test_websocket_fuzz(rserver: Server, frames: int) -> None:
    expected = await reference_tokens(rserver)
    stop = asyncio.Event()
    control = asyncio.create_task(_control_client(rserver, expected, stop))
    url = rserver.ws
    examples: list[int] = []

    @_seeded
    @seed(SEED)
    @settings(FUZZ, max_examples=max(1, frames // BATCH))
    @given(batch())
    def fuzz(sent: list[Sent]) -> None:
        examples.append(len(sent))
        with connect(url, subprotocols=["streamd.v1"], max_size=None) as ws:
            check_batch(ws, sent)
            assert ws.ping().wait(TIMEOUT), "no pong after the batch"  # the socket stays open (raises if closed)
            if len(examples) % CONTROL_EVERY:
                return
            ws.send(json.dumps({"type": "generate", "id": "same-socket", **CONTROL}))
            tokens = []
            while True:
                frames = [f for f in _frames(ws) if f.get("id") == "same-socket"]
                tokens += [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]
                if any(f["type"] == "done" for f in frames):
                    break
            assert tokens == expected

    try:
        await asyncio.to_thread(fuzz)
    finally:
        stop.set()
        rounds = await control
    assert rounds >= 1 and sum(examples) >= frames


async def _control_client(server: Server, expected: list[int], stop: asyncio.Event) -> int:
    """Runs the control request again and again on its own socket while the fuzzer runs."""
    rounds = 0
    async with ws_connect(server) as ws:
        while not stop.is_set() or rounds == 0:
            await send(ws, type="generate", id=f"ctl{rounds}", **CONTROL)
            result = (await gather_until_done(ws, {f"ctl{rounds}"}))[f"ctl{rounds}"]
            assert result.token_ids == expected, "a control stream got different tokens under fuzzing"
            rounds += 1
    return rounds


@pytest.mark.parametrize("bodies", sizes(30, HTTP_BODIES))
async def test_http_fuzz(rserver: Server, bodies: int) -> None:
    base = rserver.http

    @_seeded
    @seed(SEED)
    @settings(FUZZ, max_examples=bodies)
    @given(http_body())
    def fuzz(case: tuple[str, bytes, str]) -> None:
        path, body, content_type = case
        with httpx.Client(base_url=base, timeout=TIMEOUT) as http:
            answer = http.post(path, content=body, headers={"Content-Type": content_type})
            assert answer.status_code in (200, 400, 404, 413, 415, 429, 503), (answer.status_code, answer.text)
            if answer.headers["content-type"].startswith("application/json"):
                data = answer.json()
                if answer.status_code != 200:
                    assert data["error"]["message"] and data["error"]["code"], data
            else:
                assert answer.headers["content-type"].startswith("text/event-stream")
                last = answer.text.rstrip().rsplit("\n\n", 1)[-1]
                assert last == "data: [DONE]" or (path == "/v1/responses" and last.split("\n")[0] in (
                    "event: response.completed", "event: response.incomplete", "event: response.failed")), last
            assert http.get("/health").status_code == 200

    await asyncio.to_thread(fuzz)
