"""/metrics with the disk tier: a prompt evicted from the device by other traffic and asked again counts its
blocks under `streamd_prefix_cache_hits_total{tier="disk"}`, with the bytes read and written per tier; asked
a third time it finds them on the device, under `tier="device"`."""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import torch
from transformers import LlamaConfig

from streamd.config import load_config
from streamd.engine.client.async_engine import AsyncEngine
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.worker.model_loader import load_model
from tests.helpers import register_engine
from tests.server.test_metrics import scrape
from tests.server.util import TINY_MODEL, running_server
from tests.smollm2_tokenizer import smollm2_tokenizer

PROMPT = "The disk tier keeps this prompt " * 8
TRAFFIC = [f"Unrelated traffic number {i} " * 8 for i in range(4)]


async def test_disk_tier_hits_and_bytes_on_metrics(tmp_path: Path) -> None:
    loaded = load_model(LlamaConfig(**TINY_MODEL), torch.float32, torch.device("cpu"), seed=3)
    loaded.tokenizer = copy.deepcopy(smollm2_tokenizer())
    config = load_config(None, {"model.device": "cpu", "model.dtype": "float32", "cache.block_size": 8,
                                "cache.num_kv_blocks": 16, "cache.num_swap_blocks": 0,
                                "cache.disk_cache_dir": str(tmp_path)})
    llm_engine = register_engine(LLMEngine(config, loaded, torch.device("cpu")))
    engine = AsyncEngine(llm_engine)
    engine.start()
    try:
        async with running_server(engine) as srv, httpx.AsyncClient(base_url=srv.http, timeout=60) as http:
            body = {"max_tokens": 2, "temperature": 0}
            usages = []
            for prompt in [PROMPT, *TRAFFIC, PROMPT, PROMPT]:
                reply = await http.post("/v1/completions", json={**body, "prompt": prompt})
                assert reply.status_code == 200, reply.text
                usages.append(reply.json()["usage"])
            usage = usages[-2]
            await engine.wait_idle()
            samples = await scrape(http)
    finally:
        await engine.shutdown()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == (usage["prompt_tokens"] - 1) // 8 * 8  # every full block came back from disk
    hits = samples["streamd_prefix_cache_hits_total"]
    assert hits[(("tier", "disk"),)] == cached // 8
    assert hits[(("tier", "device"),)] == cached // 8  # the third time: the restored blocks, on the device
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] == cached
    moved = samples["streamd_prefix_cache_tier_bytes_total"]
    assert moved[(("direction", "read"), ("tier", "disk"))] > 0
    assert moved[(("direction", "written"), ("tier", "disk"))] > 0
    assert samples["streamd_prefix_cache_tier_blocks"][(("tier", "disk"),)] > 0
