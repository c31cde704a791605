"""Test helpers: the engine leak check, and reference generation with plain Hugging Face transformers."""

from __future__ import annotations

import itertools

import torch

_REQUEST_IDS = itertools.count()

# Engines under the leak check that ends every test (see conftest.py).
ENGINES: list = []


def register_engine(engine):
    """Puts an engine under the per-test leak check; returns it."""
    ENGINES.append(engine)
    return engine


def assert_pool_whole(engine) -> None:
    """No request in flight, every KV block (and swap block) free again."""
    stats = engine.stats()
    assert not engine.has_unfinished_requests(), "requests still in flight after the test"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], f"KV blocks leaked: {stats}"
    if "swap_blocks_free" in stats:
        assert stats["swap_blocks_free"] == stats["swap_blocks_total"], f"swap blocks leaked: {stats}"


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy continuation of one unpadded prompt; stops at EOS like streamd does (EOS included)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id or 0)
    return out[0, len(prompt_ids):].tolist()


def run_to_completion(engine, prompts: list, params) -> list:
    """Adds every prompt to `engine` (with one SamplingParams, or one each) and steps until all finish;
    final RequestOutputs in prompt order."""
    ids = [f"t{next(_REQUEST_IDS)}" for _ in prompts]
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for request_id, prompt, p in zip(ids, prompts, per_prompt):
        engine.add_request(request_id, prompt, p)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]
