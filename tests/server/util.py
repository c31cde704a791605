"""Helpers for server tests: running a real uvicorn server (over a given engine, or over a tiny random-weight
model with a chat template of the test's own), a WebSocket client that gathers frames."""

from __future__ import annotations

import asyncio
import copy
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from starlette.applications import Starlette
from transformers import PretrainedConfig
from websockets.asyncio.client import ClientConnection, connect

from streamd.config import load_config
from streamd.engine.client.async_engine import AsyncEngine
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.worker.model_loader import load_model
from streamd.server.app import create_app
from streamd.server.serve import DrainingServer, uvicorn_config
from streamd.server.services import Services
from tests.helpers import register_engine
from tests.smollm2_tokenizer import smollm2_tokenizer

WS_TIMEOUT = 120.0


@dataclass
class Server:
    app: Starlette
    uvicorn: DrainingServer
    port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    @property
    def services(self) -> Services:
        return self.app.state.services


@asynccontextmanager
async def running_server(engine: AsyncEngine, warm_up: bool = False, environ: dict[str, str] | None = None,
                         **server_keys: Any) -> AsyncIterator[Server]:
    overrides = {f"server.{k}": v for k, v in server_keys.items()}
    config = load_config(overrides={"server.host": "127.0.0.1", "server.port": 0, **overrides}, environ=environ or {})
    app = create_app(config, engine, warm_up=warm_up)
    srv = DrainingServer(uvicorn_config(config, app), app.state.services.lifecycle,
                         config.server.socket_send_buffer_bytes)
    task = asyncio.create_task(srv.serve())
    listening = asyncio.create_task(srv.listening.wait())
    await asyncio.wait({task, listening}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # startup failed: raise it
    assert srv.port is not None
    try:
        yield Server(app, srv, srv.port)
    finally:
        srv.should_exit = True
        await task


# A random-weight model small enough for CPU, with SmolLM2's vocabulary (its tokenizer is the real one).
TINY_MODEL = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
              "eos_token_id": 2, "bos_token_id": 1}


@asynccontextmanager
async def templated_server(config_class: type[PretrainedConfig], chat_template: str,
                           seed: int) -> AsyncIterator[Server]:
    """A server over a random-weight `config_class` model (`TINY_MODEL`) whose tokenizer is SmolLM2's with
    `chat_template` (the model family's own, e.g. to test its tool-call or reasoning format)."""
    loaded = load_model(config_class(**TINY_MODEL), torch.float32, torch.device("cpu"), seed=seed)
    loaded.tokenizer = copy.deepcopy(smollm2_tokenizer())  # (the session's shared one keeps its own template)
    loaded.tokenizer.chat_template = chat_template
    config = load_config(None, {"model.device": "cpu", "model.dtype": "float32", "cache.block_size": 8,
                                "cache.num_kv_blocks": 256, "cache.num_swap_blocks": 0})
    engine = AsyncEngine(register_engine(LLMEngine(config, loaded, torch.device("cpu"))))
    engine.start()
    try:
        async with running_server(engine) as srv:
            yield srv
    finally:
        await engine.shutdown()


async def tiny_socket(server: Server) -> socket.socket:
    """A connected socket whose receive buffer is tiny: a client that stops reading backs the server up soon."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    return sock


def ws_connect(server: Server, **kwargs: Any) -> Any:
    kwargs.setdefault("subprotocols", ["streamd.v1"])
    kwargs.setdefault("open_timeout", 30)
    return connect(server.ws, **kwargs)


async def send(ws: ClientConnection, **frame: Any) -> None:
    await ws.send(json.dumps(frame))


async def recv(ws: ClientConnection, timeout: float = WS_TIMEOUT) -> dict[str, Any]:
    """One streamd.v1 frame."""
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def recv_frames(ws: ClientConnection, timeout: float = WS_TIMEOUT) -> list[dict[str, Any]]:
    """The frames of one message: one in streamd.v1, a JSON array of them in streamd.v2."""
    message = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    if ws.subprotocol == "streamd.v2":
        assert isinstance(message, list) and message, message
        return message
    return [message]


@dataclass
class Result:
    """Everything one request id received."""

    frames: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == kind]

    @property
    def text(self) -> str:
        return "".join(f["text"] for f in self.of("delta"))

    @property
    def token_ids(self) -> list[int]:
        return [t for f in self.of("delta") for t in f["token_ids"]]

    @property
    def done(self) -> dict[str, Any]:
        (done,) = self.of("done")
        return done


async def gather_until_done(ws: ClientConnection, ids: set[str], results: dict[str, Result] | None = None,
                            stray: list[dict[str, Any]] | None = None,
                            timeout: float = WS_TIMEOUT) -> dict[str, Result]:
    """Reads frames until every id in `ids` has its `done`; frames with other ids go to `stray`."""
    results = results if results is not None else {}
    pending = set(ids)
    while pending:
        for frame in await recv_frames(ws, timeout):
            if frame.get("id") in ids:
                results.setdefault(frame["id"], Result()).frames.append(frame)
                if frame["type"] == "done":
                    pending.discard(frame["id"])
            elif stray is not None:
                stray.append(frame)
    return results


def check_stream(result: Result) -> None:
    """Protocol invariants of one finished request: start first, seq from 0, one done, usage adds up."""
    kinds = [f["type"] for f in result.frames]
    assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("done") == 1, kinds
    seqs = [f["seq"] for f in result.of("delta")]
    assert seqs == list(range(len(seqs)))
    usage = result.done["usage"]
    assert usage["completion_tokens"] == len(result.token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == result.of("start")[0]["prompt_tokens"]
