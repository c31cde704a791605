"""`streamd chat`: a terminal chat over the `streamd.v1` WebSocket.

Keeps the conversation, prints tokens as they arrive, Ctrl-C stops the current answer (a `cancel`
frame), Ctrl-D or /quit leaves. After each answer it prints time to first token and tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from streamd.server.protocol import SUBPROTOCOL_V1 as SUBPROTOCOL


def run_chat(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_chat(args))
    except KeyboardInterrupt:
        return 130


async def _chat(args: argparse.Namespace) -> int:
    key = args.api_key or os.environ.get("STREAMD_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        async with connect(args.url, subprotocols=[SUBPROTOCOL], additional_headers=headers,
                           max_size=None) as ws:
            return await _conversation(ws, args)
    except InvalidStatus as exc:
        print(f"streamd chat: the server refused the connection ({exc.response.status_code}): "
              f"{exc.response.body.decode(errors='replace')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"streamd chat: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1


async def _conversation(ws: ClientConnection, args: argparse.Namespace) -> int:
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


async def _answer(ws: ClientConnection, request_id: str, messages: list[dict[str, str]],
                  args: argparse.Namespace) -> tuple[str, bool]:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    await ws.send(json.dumps({"type": "generate", "id": request_id, "messages": messages, "params": params}))
    loop = asyncio.get_running_loop()
    cancel = lambda: asyncio.ensure_future(ws.send(json.dumps({"type": "cancel", "id": request_id})))  # noqa: E731
    interactive = args.prompt is None and sys.stdin.isatty()
    if interactive:
        loop.add_signal_handler(signal.SIGINT, cancel)
    try:
        return await _print_stream(ws, request_id)
    finally:
        if interactive:
            loop.remove_signal_handler(signal.SIGINT)


async def _print_stream(ws: ClientConnection, request_id: str) -> tuple[str, bool]:
    sent = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    tokens = 0
    while True:
        frame: dict[str, Any] = json.loads(await ws.recv())
        if frame.get("id") != request_id:
            continue
        kind = frame["type"]
        if kind == "delta":
            first = first or time.perf_counter()
            tokens += len(frame["token_ids"])
            pieces.append(frame["text"])
            print(frame["text"], end="", flush=True)
        elif kind == "error":
            print(f"\n[error {frame['error']['code']}: {frame['error']['message']}]", file=sys.stderr)
            if frame["error"]["code"] not in ("internal_error",):
                return "", False
        elif kind == "done":
            end = time.perf_counter()
            rate = (tokens - 1) / (end - first) if first and tokens > 1 and end > first else 0.0
            ttft = f"{(first - sent) * 1000:.0f} ms" if first else "-"
            print(f"\n[{frame['finish_reason']} · TTFT {ttft} · {rate:.1f} tok/s · {tokens} tokens]",
                  file=sys.stderr)
            return "".join(pieces), frame["finish_reason"] != "error"
