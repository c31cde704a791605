"""`streamd serve` on a GPU with the default layout (engine.process = "auto": the engine in its own
process on CUDA): readiness, a streamed chat completion, a WebSocket stream, a structured request, a bad
grammar refused with a 400, the pool whole afterwards (/metrics), and SIGTERM. Run on the device machine:
`python3 benchmarks/gpu_serve_smoke.py MODEL_DIR`; prints one line per check and exits non-zero on failure."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

PORT = 8765
BASE = f"http://127.0.0.1:{PORT}"


def post(path: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(BASE + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def get(path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(BASE + path, timeout=30) as response:
            return response.status, response.read()
    except (urllib.error.URLError, ConnectionError) as error:
        return getattr(error, "code", 0), b""


async def ws_stream() -> str:
    from websockets.asyncio.client import connect

    async with connect(f"ws://127.0.0.1:{PORT}/v1/stream", subprotocols=["streamd.v2"]) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "Hello",
                                  "params": {"max_tokens": 16, "ignore_eos": True}}))
        text, tokens = "", 0
        while True:
            message = json.loads(await ws.recv())
            for frame in message if isinstance(message, list) else [message]:
                if frame["type"] == "delta":
                    text += frame["text"]
                    tokens += len(frame["token_ids"])
                elif frame["type"] == "done":
                    assert tokens == 16, tokens
                    return frame["finish_reason"]


def main(model: str) -> int:
    log_file = open("/tmp/streamd-smoke.log", "w+")
    command = [sys.executable, "-m", "streamd.cli.main", "serve", "--port", str(PORT)] + (["--model", model] if model else [])
    server = subprocess.Popen(command, stderr=log_file, stdout=log_file, text=True)
    deadline = time.monotonic() + 300
    while get("/ready")[0] != 200:
        if time.monotonic() > deadline or server.poll() is not None:
            print("FAIL ready", server.poll())
            return 1
        time.sleep(1)
    print("ok ready")
    name = json.loads(get("/v1/models")[1])["data"][0]["id"]
    failures = 0
    status, body = post("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 12, "stream": True})
    chunks = [line for line in body.decode().splitlines() if line.startswith("data: {")]
    failures += check(status == 200 and bool(chunks), "chat stream", status, body)
    print("ok ws", asyncio.run(ws_stream()))
    status, body = post("/v1/completions", {"model": name, "prompt": "Yes or no? ", "max_tokens": 8,
                                            "structured_outputs": {"choice": ["yes", "no"]}})
    text = json.loads(body)["choices"][0]["text"] if status == 200 else None
    failures += check(text in ("yes", "no"), "structured", status, body)
    status, body = post("/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 4,
                                            "structured_outputs": {"regex": "(ab"}})
    failures += check(status == 400 and b"regex" in body, "bad grammar 400", status, body)
    metrics = get("/metrics")[1].decode()
    free = [line for line in metrics.splitlines() if line.startswith("streamd_kv_blocks")]
    print("metrics", free)
    server.send_signal(signal.SIGTERM)
    code = server.wait(120)
    log_file.seek(0)
    log = log_file.read()
    print("engine_process in log:", [line for line in log.splitlines() if "loading_model" in line][:1])
    print("ok sigterm exit", code)
    return 0 if code == 0 and not failures else 1


def check(ok: bool, what: str, status: int, body: bytes) -> int:
    print(f"ok {what}" if ok else f"FAIL {what} {status} {body[:300]!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
