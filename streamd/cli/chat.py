"""`streamd chat`: a terminal chat over the `streamd.v1` WebSocket.

Keeps the conversation, prints tokens as they arrive, Ctrl-C stops the current answer (a `cancel`
frame), Ctrl-D or /quit leaves. After each answer it prints time to first token and tokens/s. It finds the
server through the configuration `streamd serve` reads (`streamd.cli.settings`), and of the server's code
knows only the protocol's name (`SUBPROTOCOL_V1`).

When the connection drops mid-answer (not a close the server asked for, such as a drain's 1012), it
reconnects and sends `resume` with the answer's `resume_token` and the last `seq` it printed, so the answer
continues where it stopped, each token printed once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from streamd.cli.settings import add_config_arguments, load_settings
from streamd.config import Config, ConfigError
from streamd.server.ws.protocol import SUBPROTOCOL_V1

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

SUBPROTOCOL = Subprotocol(SUBPROTOCOL_V1)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        help="the server's WebSocket URL (default: ws://HOST:PORT/v1/stream from the "
        "config, environment and --host/--port, as `streamd serve` reads them)",
    )
    parser.add_argument("--host", help="the server's address (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="the server's port (default from config: 8000)")
    parser.add_argument(
        "--api-key", help="API key (default: STREAMD_API_KEY, else the config's first server.api_keys entry)"
    )
    parser.add_argument("--system", help="a system message")
    parser.add_argument("--prompt", help="send one message, print the answer and exit")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    add_config_arguments(parser)


def chat_main(args: argparse.Namespace) -> int:
    """Chat with a running server from the terminal, over the WebSocket."""
    config = load_settings(args, {"server.host": args.host, "server.port": args.port})
    if config.server.port == 0:
        raise ConfigError("server.port is 0 (the server picked one): give --port or --url")
    args.url = args.url or chat_url(config)
    keys = config.server.api_keys
    args.api_key = args.api_key or os.environ.get("STREAMD_API_KEY") or (keys[0] if keys else None)
    return run_chat(args)


def chat_url(config: Config) -> str:
    host = config.server.host
    if host in ("0.0.0.0", "::", ""):  # listening everywhere: this machine answers on loopback
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"ws://{host}:{config.server.port}/v1/stream"


def run_chat(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_chat(args))
    except KeyboardInterrupt:
        return 130


RECONNECT_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 4.0)  # tries after a dropped connection


class Link:
    """The chat's socket, opened again after a drop."""

    def __init__(self, url: str, headers: dict[str, str] | None) -> None:
        self.url = url
        self.headers = headers
        self.ws: ClientConnection | None = None

    async def open(self) -> None:
        from websockets.asyncio.client import connect  # (the client stack loads when a chat starts)

        self.ws = await connect(self.url, subprotocols=[SUBPROTOCOL], additional_headers=self.headers, max_size=None)

    async def reopen(self) -> bool:
        for delay in RECONNECT_DELAYS_S:
            await asyncio.sleep(delay)  # back off: the network (or the server) may need a moment
            try:
                await self.open()
                return True
            except (OSError, InvalidStatus):
                continue
        return False

    async def send(self, frame: dict[str, Any]) -> None:
        """Sends a frame, opening the socket again first if it dropped while idle."""
        assert self.ws is not None
        try:
            await self.ws.send(json.dumps(frame))
        except ConnectionClosed:
            if not await self.reopen():
                raise
            await self.ws.send(json.dumps(frame))

    async def recv(self) -> dict[str, Any]:
        assert self.ws is not None
        frame: dict[str, Any] = json.loads(await self.ws.recv())
        return frame

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


async def _chat(args: argparse.Namespace) -> int:
    key = args.api_key or os.environ.get("STREAMD_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    link = Link(args.url, headers)
    try:
        await link.open()
        try:
            return await _conversation(link, args)
        finally:
            await link.close()
    except InvalidStatus as exc:
        print(
            f"streamd chat: the server refused the connection ({exc.response.status_code}): "
            f"{exc.response.body.decode(errors='replace')}",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        print(f"streamd chat: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1


async def _conversation(ws: Link, args: argparse.Namespace) -> int:
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    loop = asyncio.get_running_loop()
    turn = 0
    while True:
        if args.prompt is not None:
            if turn:
                return 0
            line = args.prompt
        else:
            try:
                line = await loop.run_in_executor(None, input, "you> ")
            except EOFError:
                print()
                return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if not line.strip():
            continue
        turn += 1
        messages.append({"role": "user", "content": line})
        answer, ok = await _answer(ws, f"t{turn}", messages, args)
        if not ok and args.prompt is not None:
            return 1
        messages.append({"role": "assistant", "content": answer})


async def _answer(
    ws: Link, request_id: str, messages: list[dict[str, str]], args: argparse.Namespace
) -> tuple[str, bool]:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    await ws.send({"type": "generate", "id": request_id, "messages": messages, "params": params})
    loop = asyncio.get_running_loop()
    cancel = lambda: asyncio.ensure_future(ws.send({"type": "cancel", "id": request_id}))  # noqa: E731
    interactive = args.prompt is None and sys.stdin.isatty()
    if interactive:
        loop.add_signal_handler(signal.SIGINT, cancel)
    try:
        return await _print_stream(ws, request_id)
    finally:
        if interactive:
            loop.remove_signal_handler(signal.SIGINT)


async def _print_stream(ws: Link, request_id: str) -> tuple[str, bool]:
    sent = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    tokens = 0
    token: str | None = None  # the answer's resume token
    last_seq = -1
    while True:
        try:
            frame = await ws.recv()
        except ConnectionClosed as closed:
            if not await _resume(ws, request_id, token, last_seq, closed):
                return "".join(pieces), False
            continue
        if frame.get("id") != request_id:
            continue
        kind = frame["type"]
        if kind == "start":
            token = frame.get("resume_token")
        elif kind == "delta":
            if frame["seq"] <= last_seq:
                continue  # (a resume replays from after last_seq; never print a token twice)
            last_seq = frame["seq"]
            first = first or time.perf_counter()
            tokens += len(frame["token_ids"])
            pieces.append(frame["text"])
            print(frame["text"], end="", flush=True)
        elif kind == "error":
            print(f"\n[error {frame['error']['code']}: {frame['error']['message']}]", file=sys.stderr)
            if frame["error"]["code"] not in ("internal_error",):
                return "", False
        elif kind == "done":
            if token is not None:  # the answer is whole here: the server need not keep it for a resume
                await _ack(ws, request_id, token)
            end = time.perf_counter()
            rate = (tokens - 1) / (end - first) if first and tokens > 1 and end > first else 0.0
            ttft = f"{(first - sent) * 1000:.0f} ms" if first else "-"
            print(f"\n[{frame['finish_reason']} · TTFT {ttft} · {rate:.1f} tok/s · {tokens} tokens]", file=sys.stderr)
            return "".join(pieces), frame["finish_reason"] != "error"


async def _ack(ws: Link, request_id: str, token: str) -> None:
    assert ws.ws is not None
    with contextlib.suppress(ConnectionClosed):  # (unacknowledged, it is only kept a while longer)
        await ws.ws.send(json.dumps({"type": "ack", "id": request_id, "resume_token": token}))


async def _resume(ws: Link, request_id: str, token: str | None, last_seq: int, closed: ConnectionClosed) -> bool:
    """After a dropped connection: reconnect and ask for the rest of the answer."""
    code = closed.rcvd.code if closed.rcvd else None
    if token is None or code in (1000, 1008, 1009, 1012):  # not resumable, or the server closed on purpose
        reason = "the server is restarting" if code == 1012 else f"code {code}"
        print(f"\n[connection closed ({reason})]", file=sys.stderr)
        return False
    print("\n[reconnecting…]", file=sys.stderr, flush=True)
    if not await ws.reopen():
        print("[could not reconnect]", file=sys.stderr)
        return False
    await ws.send({"type": "resume", "id": request_id, "resume_token": token, "after_seq": last_seq})
    return True
