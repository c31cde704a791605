"""`streamd bench chaos --background-kills N`: background Responses whose streams are killed and resumed.

Each kill: `POST /v1/responses` with `background: true, stream: true`, read up to a random event, reset the
TCP connection (SO_LINGER 0: an RST, as a dropped network does), then
`GET /v1/responses/{id}?stream=true&starting_after=<the last sequence_number read>` for the rest. Checked:
every `sequence_number` arrives exactly once and in order up to the reference's terminal event (a resume that
loses the tail, where no text is left, is wrong too), and the final text is byte-identical to an
uninterrupted run of the same prompt (greedy, one reference run per prompt first). Afterwards the server must
go idle with no KV block in use (`chaos.idle_metrics`). Issue 32's target is 1,000 kills with none wrong.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson

PROMPTS = (
    "Name three colours and say why you like them.",
    "Write two sentences about the sea.",
    "List four animals that live on farms.",
    "Say something kind about Mondays.",
)


@dataclass(slots=True)
class KillTally:
    kills: int = 0
    exact: int = 0  # every sequence number once, and the same text as the reference
    wrong_sequence: int = 0
    wrong_text: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        return asdict(self) | {"errors": dict(sorted(self.errors.items()))}


@dataclass(slots=True, frozen=True)
class Reference:
    text: str
    num_events: int
    end: str  # the terminal event's type (`response.completed`, `.incomplete` at max_output_tokens)


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON of each `data:` line of an SSE answer (comments such as `: keepalive` skipped)."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield orjson.loads(line[6:])


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def background_kills(
    base_url: str, headers: dict[str, str], kills: int, concurrency: int, max_tokens: int, seed: int
) -> dict[str, Any]:
    """Runs `kills` kill-and-resume rounds, `concurrency` at once; returns the tally's report."""
    tally, rng = KillTally(), random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as client:
        references = {p: await _reference(client, p, max_tokens) for p in PROMPTS}
        left = iter(range(kills))

        async def worker(wrng: random.Random) -> None:
            for _ in left:
                prompt = wrng.choice(PROMPTS)
                await _one_kill(client, prompt, references[prompt], max_tokens, wrng, tally)

        await asyncio.gather(*(worker(random.Random(rng.random())) for _ in range(concurrency)))
    return tally.report()


def _body(prompt: str, max_tokens: int, background: bool) -> dict[str, Any]:
    return {
        "input": prompt,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "background": background,
    }


async def _reference(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> Reference:
    async with client.stream("POST", "/v1/responses", json=_body(prompt, max_tokens, False)) as answer:
        events = [e async for e in sse_events(answer)]
    return Reference(text_of(events), len(events), events[-1]["type"])


async def _one_kill(
    client: httpx.AsyncClient, prompt: str, ref: Reference, max_tokens: int, rng: random.Random, tally: KillTally
) -> None:
    tally.kills += 1
    cut = rng.randint(1, ref.num_events)
    try:
        first = await _read_then_reset(client, _body(prompt, max_tokens, True), cut)
        after = first[-1]["sequence_number"]
        url = f"/v1/responses/{first[0]['response']['id']}"
        async with client.stream("GET", url, params={"stream": "true", "starting_after": after}) as answer:
            answer.raise_for_status()
            rest = [e async for e in sse_events(answer)]
    except (httpx.HTTPError, KeyError, IndexError) as exc:
        name = type(exc).__name__
        tally.errors[name] = tally.errors.get(name, 0) + 1
        return
    events = first + rest
    in_order = [e["sequence_number"] for e in events] == list(range(len(events))) and events[-1]["type"] == ref.end
    same_text = text_of(events) == ref.text
    tally.wrong_sequence += not in_order
    tally.wrong_text += not same_text
    tally.exact += in_order and same_text


async def _read_then_reset(client: httpx.AsyncClient, body: dict[str, Any], cut: int) -> list[dict[str, Any]]:
    """The first `cut` events of a streamed POST, then its TCP connection reset (RST, not FIN)."""
    events: list[dict[str, Any]] = []
    async with client.stream("POST", "/v1/responses", json=body) as answer:
        answer.raise_for_status()
        sock: socket.socket = answer.extensions["network_stream"].get_extra_info("socket")
        async for event in sse_events(answer):
            events.append(event)
            if len(events) >= cut:
                break
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return events
