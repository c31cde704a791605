"""The 8-bit KV cache end to end on the CPU (`cache.kv_cache_dtype` int8 / fp8): swap preemption and prefix hits
move quantized blocks without changing a token, the pool holds more blocks in the same memory, and a bad value
is refused naming the key. Quality against the unquantized model is `streamd bench quality`'s (default model)."""

from __future__ import annotations

import pytest
import torch

from streamd import LLM, SamplingParams
from streamd.config import ConfigError
from tests.helpers import register_engine, tiny_config

CONFIG = tiny_config()
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)


def _llm(kv: str, **overrides) -> LLM:
    base = dict(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=64, seed=5, kv_cache_dtype=kv)
    llm = LLM(CONFIG, **{**base, **overrides})
    register_engine(llm.engine)
    return llm


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, CONFIG.vocab_size, (40,), generator=gen).tolist()  # 5 blocks every prompt shares
    return [shared + torch.randint(0, CONFIG.vocab_size, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 20, (8,), generator=gen)]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_swaps_and_prefix_hits_of_8bit_blocks_change_no_token(kv: str, prompts) -> None:
    alone = _llm(kv, num_kv_blocks=400, num_swap_blocks=0, enable_prefix_caching=False)
    assert alone.engine.cache.kv_cache.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    want = [alone.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    # One at a time, prefix caching on: every prompt after the first reuses the shared blocks.
    cached = _llm(kv, num_kv_blocks=400, num_swap_blocks=0)
    outs = [cached.generate(p, GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens >= 40 for o in outs[1:]), [o.num_cached_tokens for o in outs]
    # All at once in a pool that holds about two: swap preemption moves quantized blocks out and back.
    tight = _llm(kv, num_kv_blocks=16, num_swap_blocks=64, preemption_mode="swap", watermark=0.0,
                 enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, GREEDY)] == want
    stats = tight.engine.stats()
    assert stats.scheduler.preemptions_swap > 0 and stats.kv.swapped_in_blocks > 0, stats


def test_int8_pool_has_more_blocks_in_the_same_memory() -> None:
    sizes = {}
    for kv in ("auto", "int8"):
        llm = _llm(kv, cpu_kv_cache_gib=0.01, num_swap_blocks=0)
        sizes[kv] = llm.engine.cache.num_blocks
    head_dim = CONFIG.hidden_size // CONFIG.num_attention_heads
    assert sizes["int8"] / sizes["auto"] == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)


def test_a_kv_cache_dtype_it_does_not_know_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype must be one of auto, int8, fp8; got 'fp16'"):
        LLM(CONFIG, device="cpu", kv_cache_dtype="fp16")
