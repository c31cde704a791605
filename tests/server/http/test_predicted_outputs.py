"""OpenAI's Predicted Outputs (`prediction`) through a real server: the official `openai` client gets the
same greedy text with a prediction as without, and usage reports the prediction tokens accepted and
rejected; `/v1/stream` takes `prediction` too; a malformed one is refused naming the field; the speculative
decoding counters move on /metrics."""

from __future__ import annotations

import httpx
from openai import AsyncOpenAI

from tests.server.util import Server, gather_until_done, send, ws_connect

MODEL = "SmolLM2-135M-Instruct"
EDIT = (
    "Copy this note exactly, but change Monday to Thursday:\n\nThe team meets on Monday at nine in room 4. "
    "Please bring your notes and the draft plan."
)


def _client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)


async def _spec_counters(server: Server) -> tuple[float, float]:
    async with httpx.AsyncClient(base_url=server.http) as http:
        text = (await http.get("/metrics")).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("streamd_spec")}
    return values["streamd_spec_draft_tokens_total"], values["streamd_spec_accepted_tokens_total"]


async def test_openai_client_gets_the_same_text_and_accepted_prediction_tokens(server: Server) -> None:
    client = _client(server)
    messages = [{"role": "user", "content": EDIT}]
    plain = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction: no prediction counts
    drafted, accepted = await _spec_counters(server)
    predicted = await client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=30,
        prediction={"type": "content", "content": answer},
    )
    assert predicted.choices[0].message.content == answer
    assert predicted.usage.completion_tokens == plain.usage.completion_tokens
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    drafted_after, accepted_after = await _spec_counters(server)
    assert accepted_after - accepted == details.accepted_prediction_tokens
    assert drafted_after - drafted == details.accepted_prediction_tokens + details.rejected_prediction_tokens
    streamed = await client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": [{"type": "text", "text": answer}]},
    )
    parts, usage = [], None
    async for chunk in streamed:
        parts += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == answer
    assert usage is not None and usage.completion_tokens_details.accepted_prediction_tokens > 0


async def test_v1_stream_takes_a_prediction(server: Server) -> None:
    messages = [{"role": "user", "content": EDIT}]
    params = {"temperature": 0, "max_tokens": 24}
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="plain", messages=messages, params=params)
        plain = (await gather_until_done(ws, {"plain"}))["plain"]
        await send(ws, type="generate", id="pred", messages=messages, params={**params, "prediction": plain.text})
        predicted = (await gather_until_done(ws, {"pred"}))["pred"]
    assert predicted.token_ids == plain.token_ids
    assert predicted.done["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


async def test_a_malformed_prediction_is_refused_naming_it(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.http) as http:
        for prediction in ({"type": "file", "content": "x"}, {"type": "content", "content": 5}, 7):
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "prediction": prediction})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "prediction"
