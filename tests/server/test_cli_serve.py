"""A real server started the way a vLLM user starts one: `streamd serve MODEL --served-model-name a b
--api-key K` (the CLI entry, in its own process). The OpenAI SDK reaches the model by every served name and by
the full model string, is refused an unknown name (404) and refused without the key (401)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import openai
import pytest

from tests.server.test_sigterm import LogWatcher

KEY = "vllm-style-key"


async def test_a_vllm_command_line_serves_every_name(smol_dir: Path) -> None:
    model = str(smol_dir)
    command = [sys.executable, "-m", "streamd.cli.main", "serve", model, "--served-model-name", "a", "b",
               "--api-key", KEY, "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--dtype", "float32",
               "--num-kv-blocks", "64", "--set", "cache.num_swap_blocks=0", "--trust-remote-code"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMD_") and k != "VLLM_API_KEY"}
    proc = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                env={**env, "STREAMD_LOG_FORMAT": "json"})
    assert proc.stderr is not None
    log = LogWatcher(proc.stderr)
    try:
        port = (await log.wait_for("listening", 300))["port"]
        base = f"http://127.0.0.1:{port}/v1"
        client = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["a", "b"]
        for name in ("a", "b", model):
            reply = await client.chat.completions.create(model=name, max_tokens=2,
                                                         messages=[{"role": "user", "content": "Hi"}])
            assert reply.model == "a" and reply.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.NotFoundError, match="'a', 'b'"):
            await client.completions.create(model=smol_dir.name, prompt="x", max_tokens=1)
        anonymous = openai.AsyncOpenAI(base_url=base, api_key="not-the-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await anonymous.chat.completions.create(model="a", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
        assert any("--trust-remote-code has no effect" in line for line in log.lines)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
