"""Host-side checks of the running streamd container, for `make docker-test` (tests/docker/run.sh).

`python -m tests.docker.client URL -- STOP_COMMAND...` checks, from the host: `/ready`; a streamed chat
completion through the official `openai` client and one `streamd.v1` WebSocket generation, both equal
to Hugging Face `generate` on the host's copy of the default model; `/metrics` counting both; a
long answer arriving in more than one chunk. Then it starts a WebSocket stream sized to last several seconds, runs STOP_COMMAND (`docker compose stop`) once
the first token has arrived, and checks that the stream goes on during the drain and ends with its `done`
(`length`, or `cancelled` if the 30 s drain ran out on a slow machine), and that the socket closes with
1012 (service restart) as the server finishes its drain. Any failure exits non-zero, naming
the check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24
# a long answer, to see it arrive in pieces: the short one above takes ~8 tokens at ~10 ms each on the CPU, and a
# loaded host that keeps the server's event loop off the CPU that long merges them into one chunk
# (request_stream.PendingDelta), as it should
LONG_MESSAGES = [{"role": "user", "content": "Describe the city of Paris in a few sentences."}]
LONG_MAX_TOKENS = 64
TIMEOUT_S = 120.0
STOP_STREAM_S = 6.0  # the in-flight stream should last about this long: SIGTERM lands well inside it,
STOP_TOKENS = (32, 1024)  # and the 30 s drain normally lets it finish


@dataclass(slots=True)
class Reference:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    eos_token_id: int


@dataclass(slots=True)
class Stream:
    """Everything one WebSocket request received, when each token arrived, and how the socket closed."""

    frames: list[dict[str, Any]] = field(default_factory=list)
    delta_times: list[float] = field(default_factory=list)
    close_code: int | None = None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == kind]

    def add(self, frame: dict[str, Any]) -> None:
        if frame["type"] == "error":
            raise AssertionError(f"error frame: {frame}")
        self.frames.append(frame)
        if frame["type"] == "delta":
            self.delta_times.append(time.perf_counter())

    @property
    def token_ids(self) -> list[int]:
        return [t for f in self.of("delta") for t in f["token_ids"]]

    @property
    def text(self) -> str:
        return "".join(f["text"] for f in self.of("delta"))

    @property
    def done(self) -> dict[str, Any]:
        kinds = [f["type"] for f in self.frames]
        assert kinds and kinds[0] == "start" and kinds[-1] == "done" and kinds.count("done") == 1, kinds
        seqs = [f["seq"] for f in self.of("delta")]
        assert seqs == list(range(len(seqs))), f"delta seq not 0..n-1: {seqs}"
        return self.frames[-1]

    def tokens_per_second(self) -> float:
        span = self.delta_times[-1] - self.delta_times[0]
        return (len(self.delta_times) - 1) / span if span > 0 else float("inf")


def step(name: str) -> None:
    print(f"--> {name}", flush=True)


def reference(messages: list[dict[str, str]], max_tokens: int) -> Reference:
    """Greedy tokens of Hugging Face `generate` on the host's copy of the default model."""
    import torch

    from streamd.engine.output.chat_template import chat_template_ids
    from streamd.engine.worker.model_loader import load_model
    from tests.helpers import hf_greedy

    loaded = load_model(None, torch.float32, torch.device("cpu"))
    tokenizer = loaded.tokenizer
    prompt = chat_template_ids(tokenizer, messages)
    ids = hf_greedy(loaded.model, prompt, max_tokens, tokenizer.eos_token_id)
    return Reference(prompt, ids, tokenizer.decode(ids, skip_special_tokens=True), tokenizer.eos_token_id)


def expected_finish(ref: Reference) -> str:
    return "stop" if ref.token_ids and ref.token_ids[-1] == ref.eos_token_id else "length"


def check_ready(base: str) -> None:
    response = httpx.get(f"{base}/ready", timeout=10)
    assert response.status_code == 200 and response.json() == {"status": "ready"}, \
        f"/ready: {response.status_code} {response.text}"


def finished_requests(base: str) -> dict[str, float]:
    """streamd_requests_total by finish reason, and the time-to-first-token histogram's count."""
    response = httpx.get(f"{base}/metrics", timeout=10)
    assert response.status_code == 200, f"/metrics: {response.status_code}"
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "streamd_requests_total":
                counts[sample.labels["finish_reason"]] = sample.value
            elif sample.name == "streamd_time_to_first_token_seconds_count":
                counts["ttft_count"] = sample.value
    assert "ttft_count" in counts, "/metrics has no streamd_time_to_first_token_seconds histogram"
    return counts


def openai_stream(base: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[str], str | None]:
    """The content pieces of a greedy streamed chat completion through the official client, and its finish."""
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True)
    pieces: list[str] = []
    finish: str | None = None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return pieces, finish


def openai_chat(base: str, ref: Reference) -> str:
    pieces, finish = openai_stream(base, MESSAGES, MAX_TOKENS)
    text = "".join(pieces)
    assert text == ref.text, f"openai text {text!r} != transformers {ref.text!r}"
    assert finish == expected_finish(ref), f"finish_reason {finish!r}"
    return text


def check_streams(base: str) -> None:
    pieces, finish = openai_stream(base, LONG_MESSAGES, LONG_MAX_TOKENS)
    assert sum(1 for p in pieces if p) > 1, f"the answer did not stream: {pieces}"
    assert finish in ("stop", "length"), f"finish_reason {finish!r}"
    print(f"    {sum(1 for p in pieces if p)} content chunks", flush=True)


async def read_frame(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))


async def ws_generate(ws_url: str, params: dict[str, Any]) -> Stream:
    stream = Stream()
    async with connect(ws_url, subprotocols=["streamd.v1"], open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "docker", "messages": MESSAGES, "params": params}))
        while not stream.of("done"):
            stream.add(await read_frame(ws))
    return stream


def check_ws(ws_url: str, ref: Reference) -> Stream:
    stream = asyncio.run(ws_generate(ws_url, {"max_tokens": MAX_TOKENS, "temperature": 0}))
    done = stream.done
    assert stream.of("start")[0]["prompt_tokens"] == len(ref.prompt_ids), "prompt tokens differ from the host's"
    assert stream.token_ids == ref.token_ids, f"WebSocket tokens {stream.token_ids} != transformers {ref.token_ids}"
    assert done["finish_reason"] == expected_finish(ref), done
    assert done["usage"]["completion_tokens"] == len(ref.token_ids), done
    return stream


async def stop_during_stream(ws_url: str, max_tokens: int, command: list[str]) -> tuple[Stream, int, int]:
    """Starts a stream, runs `command` at its first token; returns the stream, deltas seen before the
    command was started, and the command's exit code."""
    stream = Stream()
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with connect(ws_url, subprotocols=["streamd.v1"], open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "in-flight", "messages": MESSAGES, "params": params}))
        while not stream.of("delta"):
            stream.add(await read_frame(ws))
        before = len(stream.of("delta"))
        print(f"    first token arrived; running: {' '.join(command)}", flush=True)
        stopper = await asyncio.create_subprocess_exec(*command)
        try:
            while True:
                stream.add(await read_frame(ws))
        except ConnectionClosed as closed:
            stream.close_code = closed.rcvd.code if closed.rcvd else None
        code = await asyncio.wait_for(stopper.wait(), TIMEOUT_S)
    return stream, before, code


def check_stop(ws_url: str, tokens_per_s: float, command: list[str]) -> None:
    max_tokens = int(min(max(tokens_per_s * STOP_STREAM_S, STOP_TOKENS[0]), STOP_TOKENS[1]))
    print(f"    decode ran at {tokens_per_s:.1f} tokens/s: the in-flight stream asks for {max_tokens}", flush=True)
    stream, before, code = asyncio.run(stop_during_stream(ws_url, max_tokens, command))
    assert code == 0, f"{' '.join(command)} exited {code}"
    done = stream.done
    tokens = len(stream.token_ids)
    assert tokens > before, f"no token arrived after the stop command ({before} before it)"
    assert done["usage"]["completion_tokens"] == tokens, f"done counts {done['usage']} but {tokens} arrived"
    # `length`: it finished within the drain; `cancelled`: the drain timed out first (a slow machine).
    expected = "length" if tokens == max_tokens else "cancelled"
    assert done["finish_reason"] == expected, f"{done} after {tokens} of {max_tokens} tokens"
    assert stream.close_code == 1012, f"the socket closed with {stream.close_code}, not 1012 (service restart)"
    print(f"    {before} tokens before the stop, {tokens - before} during the drain, then done "
          f"({done['finish_reason']}) and close 1012", flush=True)


def run(base: str, stop_command: list[str]) -> None:
    ws_url = base.replace("http://", "ws://", 1) + "/v1/stream"
    step("GET /ready")
    check_ready(base)
    step("reference: transformers generate on the host's copy of the default model")
    ref = reference(MESSAGES, MAX_TOKENS)
    before = finished_requests(base)
    step("streamed chat completion through the openai client")
    text = openai_chat(base, ref)
    print(f"    {text!r}", flush=True)
    step("streamd.v1 WebSocket generation")
    stream = check_ws(ws_url, ref)
    step("GET /metrics")
    after = finished_requests(base)
    reason = expected_finish(ref)
    assert after.get(reason, 0) - before.get(reason, 0) == 2, f"streamd_requests_total: {before} -> {after}"
    assert after["ttft_count"] - before["ttft_count"] == 2, f"ttft count: {before} -> {after}"
    step("a long answer streams in pieces through the openai client")
    check_streams(base)
    step("stop with a stream in flight")
    check_stop(ws_url, stream.tokens_per_second(), stop_command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the container's published URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("stop_command", nargs=argparse.REMAINDER, help="-- then the command that stops it")
    args = parser.parse_args(argv)
    command = args.stop_command[1:] if args.stop_command[:1] == ["--"] else args.stop_command
    if not command:
        parser.error("give the stop command after --")
    run(args.base.rstrip("/"), command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
