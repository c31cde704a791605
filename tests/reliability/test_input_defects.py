"""Issue 35's input defects, each on a live server driven by real clients: numbers too large for a float
field (D11), the Host allowlist against DNS rebinding (D12), the grammar compile budget, gate and cache
(D2, D3). Every test ends with the engine idle and its KV pool whole (fixtures)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.reliability.test_reproductions import error_for
from tests.server.util import Server, gather_until_done, send, ws_connect

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
