"""/metrics on a hybrid model (issue 27): while a long prompt's answer streams from a random-weight Gemma 3 text
model (five sliding layers of six, a 32-token window), the sliding layers' pool holds only the window's blocks
(`streamd_kv_window_blocks_used`) while the full layer's holds the whole context (`streamd_kv_blocks_used`),
and `streamd_kv_bytes_used` is what both hold, a fraction of what every layer would hold for the whole
context."""

from __future__ import annotations

import copy
import json

import httpx
import torch
from transformers import Gemma3TextConfig

from streamd.config import load_config
from streamd.engine.client.async_engine import AsyncEngine
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.worker.model_loader import load_model
from tests.helpers import register_engine
from tests.server.test_metrics import scrape
from tests.server.util import TINY_MODEL, running_server
from tests.smollm2_tokenizer import smollm2_tokenizer

BLOCK, WINDOW = 8, 32
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


async def test_a_long_request_holds_the_window_in_the_sliding_pool() -> None:
    gemma = Gemma3TextConfig(**{**TINY_MODEL, "num_hidden_layers": 6}, head_dim=16, sliding_window=WINDOW,
                             layer_types=LAYERS)
    loaded = load_model(gemma, torch.float32, torch.device("cpu"), seed=3)
    loaded.tokenizer = copy.deepcopy(smollm2_tokenizer())
    config = load_config(None, {"model.device": "cpu", "model.dtype": "float32", "cache.block_size": BLOCK,
                                "cache.num_kv_blocks": 128, "cache.num_swap_blocks": 0,
                                "scheduler.max_num_batched_tokens": 64})
    llm_engine = register_engine(LLMEngine(config, loaded, torch.device("cpu")))
    engine = AsyncEngine(llm_engine)
    engine.start()
    try:
        async with running_server(engine) as srv, httpx.AsyncClient(base_url=srv.http, timeout=60) as http:
            body = {"prompt": "one two three four " * 60, "max_tokens": 400, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.aiter_lines()
                async for line in lines:
                    if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                        break  # the first token: the prompt is all in the cache, the answer streams on
                samples = await scrape(http)
    finally:
        await engine.shutdown()
    full = samples["streamd_kv_blocks_used"][()]
    window = samples["streamd_kv_window_blocks_used"][()]
    assert full >= 240 // BLOCK, "the full layer keeps every position of the prompt"
    # The window's 32 positions touch 5 blocks of 8 at most, with one more ahead for the next tokens.
    assert window <= WINDOW // BLOCK + 2
    per_layer_block = 2 * TINY_MODEL["num_key_value_heads"] * BLOCK * 16 * 4  # K and V, float32
    assert samples["streamd_kv_bytes_used"][()] == (full + 5 * window) * per_layer_block
    assert samples["streamd_kv_bytes_used"][()] < 6 * full * per_layer_block / 3, "not a third of every layer"
